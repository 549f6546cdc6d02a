"""BSP — bulk synchronous parallel (Theano-MPI BSP, Crossbow's WORKER, SpeeDO --sync, MXNet-G dist_sync).

Who sends what to whom, and when:

* ``mode = grad`` (default for torch-native models): every step, after backward, every rank sums its
  learners' flat gradients and one allreduce sums them across ranks; each learner then applies its optimizer
  (momentum, weight decay) to ``G = (1/k) Σ_j g_j``. ReplicaView stay identical.
  With ``bucket_mb > 0`` the allreduce is split into buckets of that many MiB that start during backward,
  as each bucket's gradients are complete on every learner of the rank, and overlap the rest of backward
  (DDP's scheme; :mod:`mpicrossbow.rules.grad_buckets` says how, and why the results are the same).
  ``bucket_mb = 0``, a gradient that fits in one bucket (it would be ready only when backward ends, so it
  overlaps nothing), or an engine that cannot report gradients during backward (``streams``), keeps one
  allreduce of the whole buffer after backward.
* ``mode = avg`` (Theano-MPI ``avg``, SpeeDO sync): each learner takes its local step, then one allreduce
  sets every replica to ``(1/k) Σ_j w_j``. Momentum buffers stay local.
* ``mode = swap`` (Theano-MPI ``swap``): no averaging; after each local step the ranks swap their replicas
  in random pairs (:mod:`mpicrossbow.rules.pair_swap`).
* ``mode = auto``: ``grad`` when the pool exposes gradients, ``avg`` for Theano-MPI-form models, which
  update themselves inside ``train_iter``.

k is the global learner count (ranks × learners per rank) — not the GPUs of one node, as Theano-MPI's NCCL
path divided. BatchNorm running statistics are averaged (not summed) before validation and checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..config.fields import setting
from ..errors import ConfigError
from .base import Rule
from .grad_buckets import GradBuckets, contiguous, plan_buckets
from .pair_swap import PairSwap
from .registry import RULES

log = logging.getLogger(__name__)


@RULES.register("BSP")
class BSP(Rule):
    """Synchronous data parallelism: average gradients (default) or parameters every step."""

    @dataclass(frozen=True)
    class Config:
        """BSP hyper-parameters."""

        mode: Literal["auto", "grad", "avg", "swap"] = setting(
            "auto",
            "grad: average gradients; avg: average parameters after local steps; swap: ranks swap their "
            "replicas in random pairs after each step (Theano-MPI's swap); auto: grad if possible",
        )
        bucket_mb: float = setting(
            5.0,
            "grad mode: MiB per gradient bucket whose allreduce starts during backward (0, a gradient that "
            "fits in one bucket, or a communicator that does not overlap, e.g. the shared-memory one: one "
            "allreduce after backward)",
            ge=0,
        )

    name = "BSP"

    @property
    def needs_gradients(self) -> bool:
        """``mode = grad`` averages gradients; ``avg`` and ``auto`` run a model that updates itself."""
        return self.hyper.mode == "grad"

    @property
    def averages_gradients(self) -> bool:
        """Grad mode: every learner's gradient is the mean over all k after ``on_gradients``. Before bind
        ``mode = auto`` counts as grad: bind resolves it so for every torch-native model, the only kind the
        learner tuner (which asks before bind) runs."""
        return getattr(self, "mode", self.hyper.mode) in ("grad", "auto")

    @property
    def heals_from_peer(self) -> bool:
        """Grad mode, once bound: its one exchange is the gradient allreduce before the optimizer step, and
        the BatchNorm statistics are averaged between steps whole (``atomic``)."""
        return getattr(self, "mode", None) == "grad"

    @property
    def redoes_exchange(self) -> bool:
        """Grad mode with one allreduce after backward (no buckets: their allreduces start during backward,
        before a copy of the local gradient could be kept): the allreduce can run again over the survivors."""
        return getattr(self, "mode", None) == "grad" and getattr(self, "buckets", None) is None

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
        if getattr(self, "_unwatch", None) is not None:  # bound again: drop the hooks of the last binding
            self._stop_watching()
        self.buckets: GradBuckets | None = None
        self._unwatch: Callable[[], None] | None = None
        self._watch()
        assert self.comm is not None
        self.pairs = PairSwap(self.comm, [learner.params for learner in self.pool.learners])

    def _watch(self) -> None:
        """Gradient mode with buckets: plan them and hook them to the pool's backward (or say why not)."""
        assert self.pool is not None and self.comm is not None
        if self.mode != "grad" or not self.hyper.bucket_mb:
            return
        if not self.comm.overlaps:
            log.info(
                "BSP: %s completes an allreduce before returning; one allreduce after backward (buckets "
                "would only add synchronisations)",
                type(self.comm).__name__,
            )
            return
        pool = self.pool
        layout = pool.grad_layout()
        grads = [learner.grads for learner in pool.learners]
        if layout is None:
            name = type(pool).__name__
            log.info("BSP: %s reports no gradients during backward; one allreduce after it", name)
            return
        if not contiguous(layout, grads[0].numel()):
            log.warning("BSP: the parameters do not tile the flat gradient; one allreduce after backward")
            return
        bucket_bytes = round(self.hyper.bucket_mb * 2**20)
        if len(plan_buckets(layout, max(1, bucket_bytes // grads[0].element_size()))) == 1:
            log.info(
                "BSP: the gradient (%.2f MiB) is one bucket of bucket_mb = %g: one allreduce after backward "
                "(a single bucket is ready only when backward ends, so it would overlap nothing)",
                grads[0].numel() * grads[0].element_size() / 2**20,
                self.hyper.bucket_mb,
            )
            return
        self.buckets = GradBuckets(
            self.comm,
            grads,
            layout,
            bucket_bytes,
            pool.nonfinite,
            lambda: self.average("grads"),
        )
        self._unwatch = pool.watch_gradients(self.buckets.ready)

    def _stop_watching(self) -> None:
        """Remove the pool hooks (the learners changed, or training is over)."""
        if self._unwatch is not None:
            self._unwatch()
        self._unwatch, self.buckets = None, None

    def on_resize(self) -> None:
        """k is read from the pool at every average; buckets are re-hooked to the new learners."""
        log.info("BSP now over %d learner(s)", self.world_learners)
        self._stop_watching()
        self._watch()
        assert self.comm is not None and self.pool is not None
        self.pairs = PairSwap(self.comm, [learner.params for learner in self.pool.learners])

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """Elastic training lost ranks: k follows the communicator's size at every average; the buckets
        and the swap pairs are planned again over the survivors."""
        log.info("BSP now over %d learner(s) after losing rank(s) %s", self.world_learners, lost)
        self._stop_watching()
        self._watch()
        assert self.comm is not None and self.pool is not None
        self.pairs = PairSwap(self.comm, [learner.params for learner in self.pool.learners])

    def on_gradients(self, step: int) -> None:
        """Gradient mode: G = mean of every learner's gradient, before the optimizer step."""
        if self.mode != "grad":
            return
        if self.buckets is not None:
            self.buckets.finish_step()
        else:
            self.average("grads")

    def finish(self) -> None:
        """Stop watching the pool's backward (nothing is in flight between steps)."""
        self._stop_watching()

    def exchange(self, step: int) -> None:
        """Parameter mode: every replica becomes the mean replica after the local step; swap mode: this
        step's pair of ranks swap their replicas."""
        if self.mode == "swap":
            self.pairs.swap(step)
        elif self.mode == "avg":
            self.average("params")
            self.average("buffers")

    def sync_state(self) -> None:
        """Average BatchNorm running statistics so every rank validates the same model (exactly)."""
        assert self.comm is not None
        if self.mode == "grad":
            self.average("buffers", self.comm.exact, atomic=True)
