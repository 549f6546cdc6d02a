"""The text summary ``crossbow-report`` prints for each run: accuracy, time to the best, speed, exchange,
B_noise."""

from __future__ import annotations

import math

from .run_data import RunData


def summary(run: RunData) -> str:
    """Final and best validation accuracy (and when the best came), samples/s, the exchange share, the
    last gradient noise scale where one was measured."""
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
    rates = [r for r in run.rank_samples_per_second if not math.isnan(r)]
    if len(rates) > 1:
        lines.append(f"  slowest rank {min(rates):,.0f} samples/s, fastest {max(rates):,.0f}")
    return "\n".join(lines)
