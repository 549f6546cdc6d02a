"""EASGD — elastic averaging SGD (Zhang, Choromanska, LeCun, NIPS 2015; Theano-MPI, SpeeDO).

Who sends what to whom, and when:

* ``mode = sync`` (default): learners take plain local steps; every τ steps each learner computes its
  elastic difference ``d_i = x_i − x~`` from the values before the update, the differences of a rank's
  learners are summed in memory and **one allreduce** sums them across ranks; then every learner moves
  toward the centre, ``x_i ← x_i − α d_i``, and every rank moves its identical copy of the centre,
  ``x~ ← x~ + α Σ_i d_i``. k is every learner of every rank.
* ``mode = async`` (Theano-MPI's EASGD): **rank 0 serves and validates the centre and does not train**;
  workers are ranks 1..N-1 and shard the training data among themselves (:meth:`EASGD.train_shard`). Every
  τ local steps a worker rank sends a snapshot of its learners' x_j in one message to the server, which
  applies ``e_j = α (x_j − x~)``, ``x~ ← x~ + e_j`` learner by learner as each request arrives and sends
  the e_j back; the worker applies ``x_j ← x_j − e_j``.
  No barrier: a slow worker never holds the others. The protocol (one posted receive per worker, the done
  message that ends :meth:`EASGD.serve`, the once-per-epoch report) is in
  :mod:`mpicrossbow.rules.easgd_server`. k is the number of worker learners ((N − 1)·m with m learners
  per rank); a job of one rank has no worker and is rejected with a ConfigError. During training a worker
  validates its own weights; after ``finish()``, ``sync_state()`` broadcasts the final centre from rank 0.

Validation and checkpoints use the centre. ``momentum = δ`` turns the local step into EAMSGD's Nesterov
momentum (``v ← δ v − η g(x + δ v)``; every learner's optimizer gets ``nesterov = True`` and momentum δ);
left unset, the local step is the learner's optimizer from ``[optim]``. ``alpha`` defaults to 0.9/k (the
paper's β = kα = 0.9); Theano-MPI used 0.5. ``tau`` defaults to 10.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..config.fields import setting
from ..errors import ConfigError
from .base import Rule
from .easgd_server import EASGDServer, EASGDWorker, Order
from .registry import RULES
from .served_stats import learners_mean_buffers

log = logging.getLogger(__name__)

#: The rank that holds the centre in ``mode = async``.
SERVER = 0
#: β = kα, the paper's elastic coupling: a defaulted α is β / k for k learners (async: the live workers').
DEFAULT_BETA = 0.9


@RULES.register("EASGD")
class EASGD(Rule):
    """Elastic averaging every τ steps: one allreduce (``sync``) or a centre server on rank 0 (``async``).

    ``order`` is a test hook for ``mode = async``: given the number of messages the server has processed and
    the sorted ranks of the workers not yet done, it names the worker whose next message the server waits for
    (blocking), which makes the arrival order deterministic, e.g. round-robin
    ``lambda n, active: active[n % len(active)]``. Left None (always, outside tests) the server answers
    requests in the order they arrive.
    """

    @dataclass(frozen=True)
    class Config:
        """EASGD hyper-parameters."""

        mode: Literal["sync", "async"] = setting(
            "sync", "sync: one allreduce every τ steps; async: rank 0 serves the centre, ranks 1..N-1 train"
        )
        alpha: float | None = setting(
            None, "elastic rate α (default 0.9/k, k = learners in all; async: worker learners)", gt=0, le=1
        )
        tau: int = setting(10, "communication period τ in local steps", ge=1)
        momentum: float | None = setting(
            None, "EAMSGD: Nesterov momentum δ of the local step (unset: [optim])", ge=0, lt=1
        )

    name = "EASGD"

    def __init__(self, order: Order | None = None, **hyper: Any) -> None:
        super().__init__(**hyper)
        self.order = order
        self._server: EASGDServer | None = None
        self._worker: EASGDWorker | None = None
        self._steps = 0
        self._synced = False

    # ------------------------------------------------------------ async roles
    @property
    def synchronous(self) -> bool:
        """False in ``mode = async``: ranks progress at their own pace until ``finish()``."""
        return self.hyper.mode == "sync"

    @property
    def server(self) -> EASGDServer | None:
        """``async`` on rank 0 after ``bind``: the centre's server (its counters); None elsewhere."""
        return self._server

    @property
    def worker(self) -> EASGDWorker | None:
        """``async`` on ranks 1..N-1 after ``bind``: this worker's end of the protocol; None elsewhere."""
        return self._worker

    def _check_size(self, size: int) -> None:
        if not self.synchronous and size < 2:
            raise ConfigError(
                f"[rule] mode = async needs at least 2 ranks (rank 0 serves the centre, ranks 1..N-1 train); "
                f"this job has {size}"
            )

    def trains(self, rank: int, size: int) -> bool:
        """Every rank trains in ``sync`` mode; in ``async`` mode all but the server, rank 0."""
        self._check_size(size)
        return self.synchronous or rank != SERVER

    def train_shard(self, rank: int, size: int) -> tuple[int, int]:
        """``sync``: shard ``rank`` of ``size``; ``async``: the workers share the data (rank − 1 of N − 1)."""
        if self.synchronous:
            return rank, size
        self._check_size(size)
        return rank - 1, size - 1

    # ---------------------------------------------------------------- binding
    def on_bind(self) -> None:
        """The centre starts as the broadcast replica; EAMSGD reconfigures the local optimizers."""
        assert self.pool is not None and self.comm is not None
        self._check_size(self.comm.size)
        self.centre = self.pool.learners[0].params.clone()
        self.on_resize()
        k = self.world_learners if self.synchronous else (self.comm.size - 1) * len(self.pool.learners)
        if self.hyper.momentum is not None and not self.pool.has_gradients:
            raise ConfigError(
                "EASGD [rule] momentum (EAMSGD) configures the learners' optimizer, which a Theano-MPI-form "
                "model keeps to itself: leave momentum unset (the model's own update is the local step)"
            )
        if self.hyper.momentum is not None:
            for optimizer in self.pool.optimizers:
                for group in optimizer.param_groups:
                    group.update(momentum=self.hyper.momentum, nesterov=self.hyper.momentum > 0, dampening=0)
        if self.synchronous:
            delta = self.hyper.momentum
            local = "the optimizer's own" if delta is None else f"EAMSGD's Nesterov momentum δ = {delta:g}"
            log.info(
                "EASGD sync: %d learner(s), α = %g, τ = %d, local step: %s",
                k,
                self.alpha,
                self.hyper.tau,
                local,
            )
            return
        if self.comm.rank == SERVER:
            self._server = EASGDServer(
                self.comm,
                self.centre,
                self.alpha,
                self.order,
                learners=len(self.pool.learners),
                stats_size=self.pool.learners[0].buffers.numel(),
                beta=DEFAULT_BETA if self.hyper.alpha is None else None,
            )
        else:
            pool = self.pool
            self._worker = EASGDWorker(
                self.comm,
                [learner.params for learner in pool.learners],
                SERVER,
                stats=lambda: learners_mean_buffers(pool),
            )
            self._worker.patience = self.patience
        log.info(
            "EASGD async: rank %d %s; %d worker learner(s), α = %g, τ = %d",
            self.comm.rank,
            "serves the centre" if self._server else "trains",
            k,
            self.alpha,
            self.hyper.tau,
        )

    def on_resize(self) -> None:
        """α (when defaulted to 0.9/k) and one difference buffer per learner follow the learner count."""
        assert self.pool is not None and self.comm is not None
        learners = len(self.pool.learners)
        k = self.world_learners if self.synchronous else (self.comm.size - 1) * learners
        self.alpha = self.hyper.alpha if self.hyper.alpha is not None else DEFAULT_BETA / k
        if k * self.alpha > 1:
            log.warning(
                "EASGD: k·α = %d × %g > 1: the centre overshoots (the paper needs β = kα < 1)", k, self.alpha
            )
        self.diffs = [torch.zeros_like(self.centre) for _ in self.pool.learners]
        if self.synchronous:
            self.comm.share(self.diffs[0])  # the buffer every τ-th step's allreduce sums

    # -------------------------------------------------------------- exchange
    def exchange(self, step: int) -> None:
        """Every τ-th step: the allreduce of Σ d_i (``sync``) or this worker's request to the server."""
        self._steps = step + 1
        if (step + 1) % self.hyper.tau:
            return
        if not self.synchronous:
            if self._worker is not None:
                self._worker.exchange(self._progress())
            return
        assert self.pool is not None and self.comm is not None
        for learner, d in zip(self.pool.learners, self.diffs, strict=True):
            torch.sub(learner.params, self.centre, out=d)
            learner.params.sub_(d, alpha=self.alpha)
        total = self.diffs[0]
        for d in self.diffs[1:]:
            total.add_(d)
        self.comm.allreduce(total).wait()
        self.centre.add_(total, alpha=self.alpha)

    def _progress(self) -> float:
        """Epochs this worker has completed (steps over steps per epoch)."""
        assert self.pool is not None
        return self._steps / self.pool.n_batch_train

    def serve(self, report: Callable[[torch.Tensor, float], None]) -> None:
        """``async`` on rank 0: answer workers until all are done; ``report`` the centre once per epoch."""
        if self._server is None:
            super().serve(report)
            return
        assert self.pool is not None
        # validate the centre with the workers' BatchNorm statistics, not the server's initial ones
        self._server.serve(self._server.stats.reporting(self.pool, report), self.tick, self.patience)

    def finish(self) -> None:
        """A worker sends its done message; the server has nothing in flight once ``serve`` returned."""
        if self._worker is not None:
            self._worker.finish(self._progress())
        if self._server is not None and self._server.in_flight:
            raise RuntimeError(f"EASGD server finished with {self._server.in_flight} message(s) in flight")

    def backups_obstacle(self) -> str | None:
        """Asynchronous EASGD's centre is one rank's state like a parameter server's, but it has no backup
        yet: a lost centre ends the job (the synchronous mode keeps no centre rank at all)."""
        return "RULE=EASGD's centre has no backup yet (a lost centre ends the job); use ASGD or SSP"

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """Elastic training lost ranks. ``sync``: k is the survivors' learners — α (when defaulted to 0.9/k)
        follows it, and the difference buffers are shared over the new communicator; the loop then restores
        the centre of the last committed step, identical on every survivor. ``async``, after the serving
        ended (asynchronous ranks meet only then): nothing to rebuild — the centre forgot the lost workers
        as it met them (a defaulted α following the live workers from then on: ``EASGDServer.forget``)
        and keeps rank 0 (the lowest survives renumbering)."""
        if self.synchronous:
            self.on_resize()
            log.info("EASGD now over %d learner(s) after losing rank(s) %s", self.world_learners, lost)

    @property
    def served(self) -> int:
        """``async`` on rank 0: the workers' requests the centre answered so far (one elastic update per
        learner each); 0 elsewhere."""
        return self._server.updates // self._server.learners if self._server is not None else 0

    def rearm(self) -> None:
        """After a snapshot: a worker may send requests again (the server re-posts when it serves)."""
        if self._worker is not None:
            self._worker.done = False

    @property
    def in_flight(self) -> int:
        """The server's posted receives and reply sends (a worker waits for each reply at once: 0)."""
        return self._server.in_flight if self._server is not None else 0

    def sync_state(self) -> None:
        """``sync``: average the BatchNorm running statistics, so every rank validates the same centre with
        the same statistics. ``async``: broadcast the server's centre to every rank and share the workers'
        mean BatchNorm statistics (a collective: only after ``finish``). Both exact, never compressed."""
        assert self.comm is not None
        if self.synchronous:
            self.average("buffers", self.comm.exact)
            return
        self.comm.exact.broadcast(self.centre, root=SERVER).wait()  # the fp32 centre, never compressed
        self.share_trained_buffers(self._worker is not None)  # the centre has no BatchNorm statistics
        self._synced = True

    def eval_params(self) -> torch.Tensor | None:
        """Validate (and save) the centre x~; an ``async`` worker has none before ``sync_state`` (None)."""
        if self._worker is not None and not self._synced:
            return None
        return self.centre

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The centre (an ``async`` worker's: the last one broadcast), the resolved α and the counters."""
        state = {
            **super().state_dict(),
            "centre": self.centre.clone(),
            "alpha": self.alpha,
            "steps": self._steps,
        }
        if self._server is not None:
            state["updates"] = self._server.updates
            state["progress"] = dict(self._server.progress)
        if self._worker is not None:
            state["requests"] = self._worker.requests
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the centre, an explicit α and the counters (a default α follows k, set at bind, resize
        and rebind: on a resume the same k gives the same value; after an elastic loss it is the
        survivors')."""
        self.centre.copy_(state["centre"])
        if self.hyper.alpha is not None:
            self.alpha = float(state["alpha"])
        self._steps = int(state.get("steps", 0))
        if self._server is not None:
            self._server.alpha = self.alpha
            self._server.updates = int(state.get("updates", 0))
            self._server.progress.update(state.get("progress", {}))
        if self._worker is not None:
            self._worker.requests = int(state.get("requests", 0))
