"""The embedded API (``import mpicrossbow as xb``): every rule inside your own PyTorch training loop.

See :mod:`mpicrossbow.embed.api` and docs/embedded.md.
"""

from .api import (
    allreduce,
    checkpoint,
    consensus,
    distribute,
    epochs,
    finish,
    init,
    keep,
    noise_scale,
    restore,
    shard,
    trains,
)
from .grad_scaler import GradScaler

__all__ = [
    "GradScaler",
    "allreduce",
    "checkpoint",
    "consensus",
    "distribute",
    "epochs",
    "finish",
    "init",
    "keep",
    "noise_scale",
    "restore",
    "shard",
    "trains",
]
