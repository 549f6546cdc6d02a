"""BSP — bulk synchronous parallel (Theano-MPI BSP, Crossbow's WORKER, SpeeDO --sync, MXNet-G dist_sync).

Who sends what to whom, and when:

* ``mode = grad`` (default for torch-native models): every step, after backward, every rank sums its
  learners' flat gradients and one allreduce sums them across ranks; each learner then applies its optimizer
  (momentum, weight decay) to ``G = (1/k) Σ_j g_j``. Replicas stay identical.
* ``mode = avg`` (Theano-MPI ``avg``, SpeeDO sync): each learner takes its local step, then one allreduce
  sets every replica to ``(1/k) Σ_j w_j``. Momentum buffers stay local.
* ``mode = auto``: ``grad`` when the pool exposes gradients, ``avg`` for Theano-MPI-form models, which
  update themselves inside ``train_iter``.

k is the global learner count (ranks × learners per rank) — not the GPUs of one node, as Theano-MPI's NCCL
path divided. BatchNorm running statistics are averaged (not summed) before validation and checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..validate import setting
from .base import Rule
from .registry import RULES

log = logging.getLogger(__name__)


@RULES.register("BSP")
class BSP(Rule):
    """Synchronous data parallelism: average gradients (default) or parameters every step."""

    @dataclass(frozen=True)
    class Config:
        """BSP hyper-parameters."""

        mode: Literal["auto", "grad", "avg"] = setting(
            "auto",
            "grad: average gradients; avg: average parameters after local steps; auto: grad if possible",
        )

    name = "BSP"

    def on_bind(self) -> None:
        """Resolve ``auto`` and reject gradient mode for models that update themselves."""
        assert self.pool is not None
        self.mode = self.hyper.mode
        if self.mode == "auto":
            self.mode = "grad" if self.pool.has_gradients else "avg"
        if self.mode == "grad" and not self.pool.has_gradients:
            raise ConfigError(
                "[rule] mode = grad needs a torch-native model; this Theano-MPI-form model updates its own "
                "weights in train_iter, use mode = avg (or auto)"
            )
        log.info("BSP in %s mode over %d learner(s)", self.mode, self.world_learners)

    def on_resize(self) -> None:
        """Nothing per learner: k is read from the pool at every average."""
        log.info("BSP now over %d learner(s)", self.world_learners)

    def on_gradients(self, step: int) -> None:
        """Gradient mode: G = mean of every learner's gradient, before the optimizer step."""
        if self.mode == "grad":
            self.average("grads")

    def exchange(self, step: int) -> None:
        """Parameter mode: every replica becomes the mean replica after the local step."""
        if self.mode == "avg":
            self.average("params")
            self.average("buffers")

    def sync_state(self) -> None:
        """Average BatchNorm running statistics so every rank validates the same model (exactly)."""
        assert self.comm is not None
        if self.mode == "grad":
            self.average("buffers", self.comm.exact)
