"""The text summary ``crossbow-report`` prints for each run: accuracy, time to the best, speed, exchange,
B_noise, an elastic run's changes of world, what the fused engine chose and what RULE=AUTO chose.

Every figure that also has a panel is the panel's statistic, taken from the same :class:`RunData` property
and named as the panel names it: the best accuracy is the accuracy panel's star, the exchange share the
mean over ranks drawn dashed on the per-rank exchange panel, the slowest and fastest rank the samples/s
bars (by start rank), B_noise the noise panel's last labelled point, the world changes its markers."""

from __future__ import annotations

import json
import math
from typing import Any

from .run_data import RunData


def summary(run: RunData) -> str:
    """Final and best validation accuracy (and when the best came), samples/s, the exchange share (mean
    over ranks), the last gradient noise scale where one was measured, the slowest and fastest rank, an
    elastic run's changes of world with the global batch after each, and the fused engine's path and step
    form."""
    attrs = run.attrs
    best, epoch, seconds = run.best()
    final = float(attrs.get("val_accuracy", math.nan))
    lines = [
        f"{run.folder}: {run.label}",
        f"  validation accuracy: final {final:.4f}, best {best:.4f} at epoch {epoch:g} after {seconds:.1f} s",
        f"  {float(attrs.get('samples_per_second', math.nan)):,.0f} samples/s over "
        f"{float(attrs.get('wall_seconds', math.nan)):.1f} s (all ranks), {int(attrs.get('steps', 0))} "
        f"steps; exchange {run.exchange_share:.0%} of training time (mean over ranks)",
    ]
    noise = [float(v) for v in run.train.get("noise_scale", []) if math.isfinite(float(v))]
    if noise:
        lines.append(f"  gradient noise scale B_noise: {noise[-1]:,.0f} samples at the last estimate")
    for change in run.world_changes:  # the markers and the global batch's levels of the noise panel
        batch = run.global_batch_at(change.epoch, change.after)
        where = f"from step {change.step} (epoch {change.epoch:.2f})"
        lines.append(f"  elastic: {change.text} ranks {where}, global batch {batch:,.0f}")
    if "fused_choice" in attrs:
        lines.append(fused_line(json.loads(str(attrs["fused_choice"]))))
    if "rule_auto_choice" in attrs:
        lines.append(auto_line(attrs))
    rates = [(r, rank) for r, rank in zip(run.rank_samples_per_second, run.start_ranks, strict=True)]
    rates = [(r, rank) for r, rank in rates if not math.isnan(r)]
    if len(rates) > 1:
        (slow, slow_rank), (fast, fast_rank) = min(rates), max(rates)
        lines.append(
            f"  slowest rank {slow_rank} {slow:,.0f} samples/s, fastest rank {fast_rank} {fast:,.0f} "
            "(start ranks)"
        )
    return "\n".join(lines)


def fused_line(choice: dict[str, Any]) -> str:
    """The fused engine's decisions in one line (metrics.h5's ``fused_choice``, pool/fused/chooser.py): the
    path that ran, the paths refused and why, and the step form with the timings that chose it."""
    text = f"  fused engine ([pool] fuse = {choice.get('setting')}): {choice.get('path')} path"
    refused = choice.get("refused") or {}
    if refused:
        text += "; refused: " + ", ".join(f"{path} ({why})" for path, why in refused.items())
    times = choice.get("form_ms") or {}
    if times:
        timed = ", ".join(f"{form} {ms:.3f} ms" for form, ms in times.items())
        text += f"; step form {choice.get('form')} (fastest step: {timed})"
    return text


def auto_line(attrs: dict[str, Any]) -> str:
    """RULE=AUTO's decisions in one line (metrics.h5's ``rule_auto_*``, rules/auto.py): each choice with
    the step it was made at, then the last decision's line (every candidate's prediction and the figures)."""
    labels = str(attrs.get("rule_auto_labels", "")).split("; ")
    rows = [row for row in attrs.get("rule_auto_decisions", []) if len(row) == 3]
    steps = ", ".join(f"{labels[int(index)]} from step {int(step)}" for step, index, _ in rows)
    return f"  rule = AUTO: {steps}; last decision: {attrs.get('rule_auto_line', '?')}"
