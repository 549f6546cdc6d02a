"""The text summary ``crossbow-report`` prints for each run: accuracy, time to the best, speed, exchange,
B_noise, and what the fused engine chose."""

from __future__ import annotations

import json
import math
from typing import Any

from .run_data import RunData


def summary(run: RunData) -> str:
    """Final and best validation accuracy (and when the best came), samples/s, the exchange share, the
    last gradient noise scale where one was measured, and the fused engine's path and step form."""
    attrs = run.attrs
    best, epoch, seconds = run.best()
    final = float(attrs.get("val_accuracy", math.nan))
    lines = [
        f"{run.folder}: {run.label}",
        f"  validation accuracy: final {final:.4f}, best {best:.4f} at epoch {epoch:g} after {seconds:.1f} s",
        f"  {float(attrs.get('samples_per_second', math.nan)):,.0f} samples/s over "
        f"{float(attrs.get('wall_seconds', math.nan)):.1f} s, {int(attrs.get('steps', 0))} steps; exchange "
        f"{run.exchange_share:.0%} of training time",
    ]
    noise = [float(v) for v in run.train.get("noise_scale", []) if math.isfinite(float(v))]
    if noise:
        lines.append(f"  gradient noise scale B_noise: {noise[-1]:,.0f} samples at the last estimate")
    if "fused_choice" in attrs:
        lines.append(fused_line(json.loads(str(attrs["fused_choice"]))))
    rates = [r for r in run.rank_samples_per_second if not math.isnan(r)]
    if len(rates) > 1:
        lines.append(f"  slowest rank {min(rates):,.0f} samples/s, fastest {max(rates):,.0f}")
    return "\n".join(lines)


def fused_line(choice: dict[str, Any]) -> str:
    """The fused engine's decisions in one line (metrics.h5's ``fused_choice``, pool/chooser.py): the path
    that ran, the paths refused and why, and the step form with the timings that chose it."""
    text = f"  fused engine ([pool] fuse = {choice.get('setting')}): {choice.get('path')} path"
    refused = choice.get("refused") or {}
    if refused:
        text += "; refused: " + ", ".join(f"{path} ({why})" for path, why in refused.items())
    times = choice.get("form_ms") or {}
    if times:
        timed = ", ".join(f"{form} {ms:.3f} ms" for form, ms in times.items())
        text += f"; step form {choice.get('form')} (fastest step: {timed})"
    return text
