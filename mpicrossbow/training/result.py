"""What a finished session reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunResult:
    """What a finished session reports (identical on every rank): where, how long, how well."""

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
