"""The parameter-server substrate: rank 0 holds the global model, workers push deltas and pull it back.

Who sends what to whom, and when (SpeeDO's async mode, MXNet-G's ``dist_async``/``dist_ssync``, Ho et al.'s
SSP): rank 0 serves and does not train; workers are ranks 1..N-1 and share the training data. Every τ local
steps a worker sends ``Δ = x − x_pulled`` (its progress since it last pulled) with a non-blocking send and
waits for the reply, the server's current w, which it adopts (``x ← w``, ``x_pulled ← w``). The server
keeps **one posted receive per worker** and serves each push as it arrives: ``w ← w + scale · Δ`` and the
worker's clock (its pushes) goes up by one. It replies at once, unless the worker is more than
``staleness`` clocks ahead of the slowest worker still training (``c − c_min > s``): then the reply waits
until the slow ones catch up (SSP). ``staleness = None`` never waits (asynchronous SGD).

Termination as in asynchronous EASGD: a worker's last message (same channel, flag set) says done; a done
worker no longer counts for c_min, and the server leaves :meth:`ParameterServer.serve` once every worker is
done, no reply waits and every reply send has completed: nothing is in flight.

A request is ``[Δ (n values), flag, progress]``; progress (epochs done) drives the once-per-epoch report of
the server's model, as for asynchronous EASGD. One learner per worker rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..comm.base import Communicator, Handle
from ..errors import ConfigError
from .base import Rule
from .request_loop import Order, serve_requests

log = logging.getLogger(__name__)

PUSH_TAG, PULL_TAG = 7201, 7202
UPDATE, DONE = 0.0, 1.0
Report = Callable[[torch.Tensor, float], None]
SERVER = 0


class Policy:
    """When the server merges a push and when it replies: asynchronous SGD's answer is always, at once.

    Subclasses (SSP's staleness bound, SpeeDO's partial synchrony and weed-out) override the two questions.
    """

    def accept(self, server: ParameterServer, r: int) -> bool:
        """Merge worker r's push (True) or discard it (False: r restarts from w)."""
        return True

    def hold(self, server: ParameterServer, r: int) -> None:
        """Worker r's reply is about to be held: remember what releasing it will depend on."""

    def releasable(self, server: ParameterServer, r: int) -> bool:
        """Whether the reply held for worker r may go out now."""
        return True


class StalenessBound(Policy):
    """SSP: hold a reply while the worker's clock exceeds the slowest training worker's by more than s."""

    def __init__(self, staleness: int) -> None:
        self.staleness = staleness

    def releasable(self, server: ParameterServer, r: int) -> bool:
        """``c_r − c_min ≤ s``."""
        return server.clock[r] <= server.c_min() + self.staleness


class ParameterServer:
    """Rank 0's loop: apply each push as it arrives, reply with w (held back while too far ahead)."""

    def __init__(
        self, comm: Communicator, w: torch.Tensor, scale: float, policy: Policy, order: Order | None
    ) -> None:
        self.comm, self.w, self.scale, self.policy, self.order = comm, w, scale, policy, order
        self.workers = [r for r in range(comm.size) if r != comm.rank]
        n = w.numel()
        self._inbox = {r: w.new_zeros(n + 2) for r in self.workers}
        self._outbox = {r: w.new_zeros(n) for r in self.workers}
        self._recvs: dict[int, Handle] = {}
        self._sends: dict[int, Handle] = {}
        self.clock = dict.fromkeys(self.workers, 0)
        self.progress = dict.fromkeys(self.workers, 0.0)
        self.done: set[int] = set()
        self.held: list[int] = []
        #: Pushes applied to w so far, and pushes received (applied or discarded).
        self.updates = 0
        self.received = 0
        #: ``received`` when each worker last pulled (weed-out's staleness measure).
        self.pulled_at = dict.fromkeys(self.workers, 0)
        self.discarded = 0
        #: Replies that had to wait (staleness bound, partial synchrony).
        self.holds = 0
        self._reported = 0

    @property
    def in_flight(self) -> int:
        """Posted receives, held replies and unfinished reply sends (0 after :meth:`serve`)."""
        return len(self._recvs) + len(self._sends) + len(self.held)

    def c_min(self) -> int:
        """The slowest clock among workers still training (∞ when all are done)."""
        active = [self.clock[r] for r in self.workers if r not in self.done]
        return min(active) if active else math.inf  # type: ignore[return-value]

    def serve(self, report: Report) -> None:
        """Serve pushes until every worker is done and nothing is in flight."""
        for r in self.workers:
            self._recvs[r] = self.comm.irecv(self._inbox[r], r, PUSH_TAG)
        serve_requests(self._recvs, lambda r: self._handle(r, report), self.order)
        for handle in self._sends.values():
            handle.wait()
        self._sends.clear()
        log.info(
            "parameter server: %d update(s) from %d worker(s), all done", self.updates, len(self.workers)
        )

    def _handle(self, r: int, report: Report) -> None:
        del self._recvs[r]
        msg, n = self._inbox[r], self.w.numel()
        self.progress[r] = float(msg[n + 1])
        if float(msg[n]) == DONE:
            self.done.add(r)
        else:
            self.received += 1
            if self.policy.accept(self, r):
                self.w.add_(msg[:n], alpha=self.scale)
                self.updates += 1
            else:
                self.discarded += 1
            self.clock[r] += 1
            self.policy.hold(self, r)
            self.held.append(r)
        self._release()
        if r in self.held:
            self.holds += 1
        epoch = sum(self.progress.values()) / len(self.workers)
        if math.floor(epoch) > self._reported:
            self._reported = math.floor(epoch)
            report(self.w, epoch)

    def _release(self) -> None:
        """Reply to every held worker within the staleness bound, then re-post its receive."""
        for r in [r for r in self.held if self.policy.releasable(self, r)]:
            self.held.remove(r)
            self.pulled_at[r] = self.received
            if r in self._sends:
                self._sends.pop(r).wait()
            self._outbox[r].copy_(self.w)
            self._sends[r] = self.comm.isend(self._outbox[r], r, PULL_TAG)
            self._recvs[r] = self.comm.irecv(self._inbox[r], r, PUSH_TAG)


class ServerRule(Rule):
    """Base of the parameter-server rules: rank 0 serves, ranks 1..N-1 push every τ steps and pull."""

    def policy(self) -> Policy:
        """When the server merges and replies (asynchronous SGD: always, at once)."""
        return Policy()

    def __init__(self, order: Order | None = None, **hyper: Any) -> None:
        super().__init__(**hyper)
        self.order = order
        self.server: ParameterServer | None = None
        self._steps = 0
        self._synced = False

    @property
    def synchronous(self) -> bool:
        """Ranks progress at their own pace until ``finish()``."""
        return False

    def _check(self, size: int) -> None:
        if size < 2:
            raise ConfigError(
                f"RULE={self.name} needs at least 2 ranks (rank 0 serves the model, ranks 1..N-1 train); "
                f"this job has {size}"
            )

    def trains(self, rank: int, size: int) -> bool:
        """Every rank but the server trains."""
        self._check(size)
        return rank != SERVER

    def train_shard(self, rank: int, size: int) -> tuple[int, int]:
        """The workers share the data: shard rank − 1 of N − 1."""
        self._check(size)
        return rank - 1, size - 1

    def scale(self) -> float:
        """The factor a push is applied with (``[rule] scale``; 0 means 1/workers)."""
        assert self.comm is not None
        return self.hyper.scale or 1.0 / (self.comm.size - 1)

    def on_bind(self) -> None:
        """w on the server, x_pulled on a worker; one learner per worker."""
        assert self.pool is not None and self.comm is not None
        self._check(self.comm.size)
        if len(self.pool.learners) != 1:
            raise ConfigError(f"RULE={self.name} runs one learner per rank; set [pool] learners = 1")
        self.w = self.pool.learners[0].params.clone()
        if self.comm.rank == SERVER:
            self.server = ParameterServer(self.comm, self.w, self.scale(), self.policy(), self.order)
            return
        x = self.pool.learners[0].params
        self.pulled = x.clone()
        self.request = x.new_zeros(x.numel() + 2)
        self.requests = 0

    def _progress(self) -> float:
        assert self.pool is not None
        return self._steps / self.pool.n_batch_train

    def _push(self, flag: float) -> None:
        assert self.pool is not None and self.comm is not None
        x, n = self.pool.learners[0].params, self.w.numel()
        if flag == DONE:
            self.request[:n].zero_()
        else:
            torch.sub(x, self.pulled, out=self.request[:n])
        self.request[n], self.request[n + 1] = flag, self._progress()
        if flag == DONE:
            self.comm.isend(self.request, SERVER, PUSH_TAG).wait()
            return
        recv = self.comm.irecv(self.w, SERVER, PULL_TAG)
        send = self.comm.isend(self.request, SERVER, PUSH_TAG)
        recv.wait()  # held back by the server while this worker is too far ahead (SSP)
        send.wait()
        x.copy_(self.w)
        self.pulled.copy_(self.w)
        self.requests += 1

    def exchange(self, step: int) -> None:
        """Every τ-th step a worker pushes Δ and adopts the server's w."""
        self._steps = step + 1
        if self.server is None and self._steps % self.hyper.tau == 0:
            self._push(UPDATE)

    def serve(self, report: Report) -> None:
        """Rank 0: the parameter server's loop."""
        if self.server is None:
            super().serve(report)
            return
        self.server.serve(report)

    def finish(self) -> None:
        """A worker sends done; the server has nothing in flight once serve() returned."""
        if self.server is None and self.comm is not None:
            self._push(DONE)
        elif self.server is not None and self.server.in_flight:
            raise RuntimeError(f"parameter server finished with {self.server.in_flight} message(s) in flight")

    @property
    def in_flight(self) -> int:
        """The server's outstanding requests (a worker waits for each reply at once: 0)."""
        return self.server.in_flight if self.server is not None else 0

    def sync_state(self) -> None:
        """After finish: every rank gets the server's final w (a collective; exact, never compressed)."""
        assert self.comm is not None
        self.comm.exact.broadcast(self.w, root=SERVER).wait()
        self._synced = True

    def eval_params(self) -> torch.Tensor | None:
        """The server's w (on a worker: only after sync_state)."""
        return self.w if self.server is not None or self._synced else None

    def state_dict(self) -> dict[str, Any]:
        """w and the counters."""
        state = {**super().state_dict(), "w": self.w.clone(), "steps": self._steps}
        if self.server is not None:
            state.update(updates=self.server.updates, clock=dict(self.server.clock))
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore w and the counters."""
        self.w.copy_(state["w"])
        self._steps = int(state.get("steps", 0))
        if self.server is not None:
            self.server.updates = int(state.get("updates", 0))
            self.server.clock.update(state.get("clock", {}))
