"""Precision: the arithmetic of a pool's forward pass — fp32, or bf16/fp16 autocast with fp32 master weights.

``[optim] precision`` (the embedded API: ``xb.distribute(..., precision=...)``):

* ``fp32``: as the model is written.
* ``bf16``: the forward (and the loss) runs under ``torch.autocast`` with bfloat16, on CUDA and on the
  CPU alike. bf16 has fp32's exponent range, so gradients need no scaling.
* ``fp16``: autocast with float16, and the loss multiplied by a :class:`~.loss_scale.LossScale` before
  backward; the step (:func:`~mpicrossbow.training.run.step.train_step`) divides it out and every rank skips
  the steps whose gradients overflowed on any rank.

What stays fp32 whatever the setting, as DDP's, DeepSpeed's and Lightning's mixed precision keep it: the
weights (the master copy), the flat gradient and buffer tensors, the optimizer state and every rule's state
(SMA's z, EASGD's centre, a parameter server's w). Autocast casts each weight to 16 bits inside the operator
that reads it and autograd casts its gradient back, so nothing outside the forward ever sees a 16-bit
tensor. The backward runs outside autocast (torch's advice: it follows the forward's dtypes itself).

On a GPU with tensor cores for it (Ampere and newer), ``[optim] tf32`` lets fp32 matmuls and convolutions
use TF32 (a process-wide torch switch, set when a pool is built on a CUDA device).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch

from .loss_scale import LossScale

#: Setting name → the autocast dtype (None: no autocast).
DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """How a rank's learners compute their forward pass and scale their loss (one per pool)."""

    def __init__(
        self,
        name: Literal["fp32", "bf16", "fp16"] = "fp32",
        device: torch.device | str = "cpu",
        loss_scale: float = 0.0,
        window: int = 2000,
    ) -> None:
        if name not in DTYPES:
            raise ValueError(f"precision {name!r}: choose one of {', '.join(DTYPES)}")
        self.name = name
        self.device_type = torch.device(device).type
        #: The 16-bit dtype autocast computes in, or None (fp32).
        self.dtype = DTYPES[name]
        #: fp16's loss scale (None for fp32 and bf16: their gradients are never scaled).
        self.loss_scale = LossScale(loss_scale, window) if name == "fp16" else None

    @staticmethod
    def of(optim: Any, device: torch.device) -> Precision:
        """The precision ``[optim]`` asks for (``precision``, ``loss_scale``, ``loss_scale_window``,
        ``tf32``), on ``device``; sets CUDA's TF32 switches there."""
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = optim.tf32
            torch.backends.cudnn.allow_tf32 = optim.tf32
        return Precision(optim.precision, device, optim.loss_scale, optim.loss_scale_window)

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward (1 unless fp16; the backward itself:
        :class:`~.step_gradients.StepGradients`)."""
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    def autocast(self) -> AbstractContextManager[Any]:
        """The context a learner's forward and loss run in: autocast to :attr:`dtype`, or nothing. While a
        CUDA graph captures (:mod:`.cuda_graphs`) without autocast's cache of cast weights, as torch requires:
        a cached cast made in one capture would be freed memory in the next replay."""
        if self.dtype is None:
            return nullcontext()
        capturing = self.device_type == "cuda" and torch.cuda.is_current_stream_capturing()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=not capturing)

    def state_dict(self) -> dict[str, Any]:
        """The loss scale's state (empty without one), for a checkpoint."""
        return self.loss_scale.state_dict() if self.loss_scale is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values; a checkpoint without a loss scale leaves this one as it is."""
        if self.loss_scale is not None and state:
            self.loss_scale.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, {self.device_type!r}, scale={self.scale:g})"


#: The precision of a pool built without one (fp32: nothing changes).
FP32 = Precision()
