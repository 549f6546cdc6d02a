"""Learning-rate schedule: linear warm-up, then step or multistep decay, evaluated per step, with the peak
rate scaled by the learner count (``[optim] lr_scaling``)."""

from __future__ import annotations

import bisect
import math

from ...config import OptimSection


def lr_scale(scaling: str, learners: int) -> float:
    """The factor ``[optim] lr_scaling`` multiplies the base rate by for ``learners`` learners in all: 1
    (``none``), √k (``sqrt``) or k (``linear``). Model averaging moves the centre by about one learner's
    step per step, so k learners at an unscaled rate make about 1/k of one learner's progress per epoch."""
    if learners < 1:
        raise ValueError(f"learners = {learners}: need at least one")
    if scaling == "linear":
        return float(learners)
    if scaling == "sqrt":
        return math.sqrt(learners)
    if scaling == "none":
        return 1.0
    raise ValueError(f"lr_scaling = {scaling!r}: use none, sqrt or linear")


def lr_at(optim: OptimSection, epoch: float, learners: int = 1) -> float:
    """The learning rate at fractional ``epoch`` (epoch 1.5 = half-way through the second epoch) with
    ``learners`` learners in all (ranks that train × learners per rank).

    The peak is ``lr × lr_scale(lr_scaling, learners)``, at most ``lr_cap`` where one is set; the warm-up
    rises linearly from a tenth of the unscaled ``lr`` to it, and the step or multistep decay multiplies it.
    Called every step, so the rate follows the auto-tuner when it changes the learner count between epochs.
    """
    peak = optim.lr * lr_scale(optim.lr_scaling, learners)
    if optim.lr_cap:
        peak = min(peak, optim.lr_cap)
    lr = peak
    if optim.schedule == "step":
        lr *= optim.gamma ** int(epoch // optim.step_epochs)
    elif optim.schedule == "multistep":
        lr *= optim.gamma ** bisect.bisect_right(sorted(optim.milestones), int(epoch))
    if optim.warmup_epochs > 0 and epoch < optim.warmup_epochs:
        start = optim.lr / 10
        lr = start + (lr - start) * epoch / optim.warmup_epochs
    return lr
