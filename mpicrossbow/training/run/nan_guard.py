"""``[session] on_nan``: a NaN or infinite loss stops the job with a message, or skips that batch.

On the CPU the check reads the step's losses at once. On a CUDA device reading them would make the host wait
for the step's forward and backward every step, so the host could never queue the next step's batch and
kernels while the GPU computes (with CUDA graphs a small model's step is a few launches, and the host's own
work per step is the rest). There the guard works
without waiting: each step it zeroes the flagged learners' gradients on the device (which is what ``skip``
does, so a NaN never reaches the rule or the optimizer), copies the flags into page-locked memory and records
an event, and reads a step's flags on the host once the device has computed them, at a later step's check
or at the end of the epoch (:meth:`NanGuard.flush`). So under ``skip`` the warning comes a step or two late,
and under ``stop`` the job stops a step or two after the bad batch, with the parameters untouched by it.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from ...pool.base import LearnerPool
from ..health.faults import FaultInjector

log = logging.getLogger(__name__)

#: Steps whose flags may be in flight before the host waits for the oldest (the host runs at most this far
#: ahead of the device on account of the guard; each holds a few bytes of page-locked memory).
IN_FLIGHT = 4


class Written:
    """The event of flags a CPU device wrote at once: always complete (the deferred path on the CPU)."""

    def query(self) -> bool:
        """Complete."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


class NonFiniteLoss(RuntimeError):
    """A learner's training loss became NaN or infinite and ``[session] on_nan = stop``."""


class NanGuard:
    """The NaN policy of one rank's loop, checked after each step's backward (:meth:`check`)."""

    def __init__(self, on_nan: str, defer: bool | None = None) -> None:
        """``defer``: read the flags when the device has written them (None: on a CUDA device only; on the
        CPU they are written at once, so deferring there only shows the deferred path's behaviour)."""
        self.on_nan, self.defer = on_nan, defer
        self._pending: deque[tuple[int, int, torch.Tensor, torch.cuda.Event | Written]] = deque()

    def check(self, pool: LearnerPool, faults: FaultInjector, step: int, epoch: int) -> None:
        """After step ``step``'s backward: raise :class:`NonFiniteLoss`, or (``on_nan = skip``) zero the bad
        gradients; deferred on a CUDA device (the module's docstring).

        ``[inject] action = nan`` poisons learner 0 here first. Theano-MPI-form models report their own cost
        through the recorder and are not checked. Under fp16's loss scale a non-finite loss or gradient is
        an overflow, not a policy matter: the step's agreed unscale skips it on every rank and halves the
        scale (:mod:`~mpicrossbow.pool.loss_scale`; a scale that falls below 1 stops the job).
        """
        if not pool.has_gradients:
            return
        learners = pool.learners
        faults.poison(step, [lr.last_loss for lr in learners], [lr.grads for lr in learners])
        if pool.scaled_gradients:
            return
        defer = learners[0].grads.is_cuda if self.defer is None else self.defer
        flags = pool.nonfinite_flags() if defer else None
        if flags is None:
            self._act(pool.nonfinite(), step, epoch, pool)
            return
        pool.zero_gradients_where(flags)
        event: torch.cuda.Event | Written
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flags.clone(), Written()
        self._pending.append((step, epoch, host, event))
        self._read(wait=len(self._pending) > IN_FLIGHT)

    def flush(self) -> None:
        """Read every step's flags still in flight, waiting for the device (an epoch's end, a stop)."""
        self._read(wait=True, every=True)

    def _read(self, wait: bool, every: bool = False) -> None:
        """Act on the pending steps whose flags the device has written, oldest first; ``wait``: for the
        oldest at least, ``every``: for all of them."""
        while self._pending:
            step, epoch, host, event = self._pending[0]
            if wait or every:
                event.synchronize()
            elif not event.query():
                return
            self._pending.popleft()
            wait = False
            bad = [j for j, flag in enumerate(host.tolist()) if flag]
            if bad:
                self._act(bad, step, epoch, None)

    def _act(self, bad: list[int], step: int, epoch: int, pool: LearnerPool | None) -> None:
        """The policy on learners ``bad`` of step ``step``; ``pool``: zero their gradients here (the
        immediate check; the deferred one zeroed them on the device already)."""
        if not bad:
            return
        where = f"step {step} (epoch {epoch + 1}), learner(s) {', '.join(map(str, bad))}"
        if self.on_nan == "stop":
            self._pending.clear()
            raise NonFiniteLoss(
                f"training loss is NaN or infinite at {where}; lower [optim] lr, check the data, or set "
                "[session] on_nan = skip"
            )
        log.warning("loss is NaN or infinite at %s: that batch is skipped (its gradient zeroed)", where)
        if pool is not None:
            for j in bad:
                pool.learners[j].grads.zero_()
