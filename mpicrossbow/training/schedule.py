"""Learning-rate schedule: linear warm-up, then step or multistep decay, evaluated per step."""

from __future__ import annotations

import bisect

from ..config import OptimSection


def lr_at(optim: OptimSection, epoch: float) -> float:
    """The learning rate at fractional ``epoch`` (epoch 1.5 = half-way through the second epoch)."""
    lr = optim.lr
    if optim.schedule == "step":
        lr *= optim.gamma ** int(epoch // optim.step_epochs)
    elif optim.schedule == "multistep":
        lr *= optim.gamma ** bisect.bisect_right(sorted(optim.milestones), int(epoch))
    if optim.warmup_epochs > 0 and epoch < optim.warmup_epochs:
        start = optim.lr / 10
        lr = start + (lr - start) * epoch / optim.warmup_epochs
    return lr
