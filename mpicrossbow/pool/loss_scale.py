"""LossScale: fp16's loss scaling, with skip decisions every rank of a synchronous job agrees on.

fp16 holds magnitudes from about 6e-8 (subnormal) to 65504: a gradient smaller than that vanishes in a
half-precision backward. So the loss is multiplied by a scale S before backward, every gradient carries the
factor S through the fp16 kernels, and the fp32 gradients are divided by S again before anyone reads them
(:meth:`LossScale.unscale`). A scale too large overflows: some gradient becomes inf or NaN, that step is
skipped and S halves; after ``window`` steps without an overflow S doubles (torch's ``GradScaler`` and
DeepSpeed's dynamic scaler do the same).

**Why an agreement.** torch's ``GradScaler`` decides per process: the rank whose gradients overflowed skips
its optimizer step, the others step. Under a synchronous rule that desynchronises the job — BSP's replicas
differ from then on, and a rank that skips its collective while its peers enter it hangs the job. Here the
overflow flag is one value allreduced with MAX through the rule's communicator, so every rank skips the
same steps and every rank's scale moves alike (the caller passes that agreement in:
:func:`~mpicrossbow.training.run.step.overflow_anywhere`, the one place it is written). Asynchronous rules run
no collective between ``bind`` and ``finish``: their ranks decide alone, as their steps are independent
anyway.

A scale that would fall below ``floor`` (1: the loss itself no longer fits) stops the job: the gradients
are inf or NaN before any scaling, which is divergence, not overflow.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The first scale of a dynamic loss scale (torch's GradScaler starts there too).
INITIAL_SCALE = 2.0**16


class LossScaleUnderflow(RuntimeError):
    """The dynamic loss scale fell below its floor: the gradients overflow even unscaled (divergence)."""


class LossScale:
    """A loss scale, fixed (``fixed > 0``) or dynamic (``fixed = 0``: halve on overflow, double after
    ``window`` clean steps)."""

    def __init__(self, fixed: float = 0.0, window: int = 2000, floor: float = 1.0) -> None:
        if fixed < 0 or window < 1:
            raise ValueError(f"loss scale {fixed} or window {window} out of range")
        self.dynamic = fixed == 0
        self.scale = INITIAL_SCALE if self.dynamic else float(fixed)
        self.window, self.floor = window, floor
        #: Steps since the last overflow (or the last growth).
        self.clean = 0
        #: Steps skipped because some rank's gradients overflowed.
        self.skipped = 0

    def unscale(self, grads: Sequence[torch.Tensor], agree: Callable[[bool], bool] | None = None) -> bool:
        """Divide ``grads`` by the scale in place, ``agree`` with the other ranks (this rank's overflow →
        whether any rank overflowed; None: alone, the step's :func:`~mpicrossbow.training.run.step.
        overflow_anywhere` in training) and update the scale; True when the step goes on.

        On an overflow every gradient is zeroed, so nothing downstream reads an inf.
        """
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        inverse = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=grads[0].device)
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            if grad.numel():
                by_dtype.setdefault((grad.device, grad.dtype), []).append(grad)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inverse)
        overflow = bool(found.item())  # the one host synchronisation of the check
        if agree is not None:
            overflow = agree(overflow)
        if overflow:
            for grad in grads:
                grad.zero_()
        self.update(bool(overflow))
        return not overflow

    def update(self, overflow: bool) -> None:
        """Halve the scale after an overflow, double it after ``window`` clean steps (dynamic only)."""
        if overflow:
            self.skipped += 1
            self.clean = 0
            if not self.dynamic:
                log.info(
                    "fp16: gradients overflowed (on this or another rank): step skipped on every rank, loss "
                    "scale stays %g",
                    self.scale,
                )
                return
            if self.scale / 2 < self.floor:
                raise LossScaleUnderflow(
                    f"fp16 loss scale would fall below {self.floor:g} after {self.skipped} skipped step(s): "
                    "the gradients are inf or NaN even unscaled; lower [optim] lr, check the data, or train "
                    "with [optim] precision = bf16"
                )
            self.scale /= 2
            log.info(
                "fp16: gradients overflowed (on this or another rank): step skipped on every rank, loss "
                "scale now %g",
                self.scale,
            )
            return
        self.clean += 1
        if self.dynamic and self.clean >= self.window and math.isfinite(self.scale * 2):
            self.scale *= 2
            self.clean = 0

    def state_dict(self) -> dict[str, Any]:
        """The scale and its counters (a checkpoint resumes them exactly)."""
        return {"scale": self.scale, "clean": self.clean, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values."""
        self.scale = float(state["scale"])
        self.clean, self.skipped = int(state["clean"]), int(state["skipped"])
