"""``[session] on_nan``: a NaN or infinite loss stops the job with a message, or skips that batch."""

from __future__ import annotations

import logging

from ...pool.base import LearnerPool
from ..health.faults import FaultInjector

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """A learner's training loss became NaN or infinite and ``[session] on_nan = stop``."""


def check_finite(pool: LearnerPool, faults: FaultInjector, on_nan: str, step: int, epoch: int) -> None:
    """After a step's backward: raise :class:`NonFiniteLoss`, or (``on_nan = skip``) zero the bad gradients.

    ``[inject] action = nan`` poisons learner 0 here first. Theano-MPI-form models report their own cost
    through the recorder and are not checked. Under fp16's loss scale a non-finite loss or gradient is an
    overflow, not a policy matter: the step's agreed unscale skips it on every rank and halves the scale
    (:mod:`~mpicrossbow.pool.loss_scale`; a scale that falls below 1 stops the job).
    """
    if not pool.has_gradients:
        return
    learners = pool.learners
    faults.poison(step, [lr.last_loss for lr in learners], [lr.grads for lr in learners])
    if pool.scaled_gradients:
        return
    bad = pool.nonfinite()
    if not bad:
        return
    where = f"step {step} (epoch {epoch + 1}), learner(s) {', '.join(map(str, bad))}"
    if on_nan == "stop":
        raise NonFiniteLoss(
            f"training loss is NaN or infinite at {where}; lower [optim] lr, check the data, or set "
            "[session] on_nan = skip"
        )
    log.warning("loss is NaN or infinite at %s: that batch is skipped (its gradient zeroed)", where)
    for j in bad:
        learners[j].grads.zero_()
