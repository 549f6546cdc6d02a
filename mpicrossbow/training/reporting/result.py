"""What a finished session reports."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RunResult:
    """What a finished session reports (identical on every rank, times by each rank's clock): where, how
    long, how well, and when ``[session] target_accuracy`` was reached."""

    run_dir: str
    epochs: int
    steps: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    wall_seconds: float
    exchange_seconds: float
    samples_per_second: float
    #: A signal (SIGTERM/SIGUSR1) stopped the run before its end, after a checkpoint: not finished.
    stopped: bool = False
    #: Seconds of this rank's training loop: set-up, validations and the final metrics left out.
    train_seconds: float = math.nan
    #: Training seconds (validation left out) until the first validation at the target; NaN: not reached.
    target_seconds: float = math.nan
    #: Epochs (fractional) trained until then; NaN: not reached.
    target_epochs: float = math.nan
    #: ``(training seconds, epochs, validation accuracy)`` of every validation (not a metrics.h5 attribute).
    curve: tuple[tuple[float, float, float], ...] = ()
