"""GOSGD — gossip SGD (Blot, Picard, Cord, Thome 2016; Theano-MPI GOSGD). Asynchronous: no collectives.

Who sends what to whom, and when: every learner i keeps its weights x_i and a gossip weight a_i (initially
1/k). It takes its optimizer's local step every step; then (``exchange``) it merges every message that has
arrived, ``x_i ← (a_i x_i + a_s x_s) / (a_i + a_s)``, ``a_i ← a_i + a_s``, and with probability ``p`` picks
another rank j uniformly (a numpy generator seeded by ``(seed, rank)``), halves a_i and sends (x_i, a_i) to
j. A message is two non-blocking point-to-point transfers, never pickled: a snapshot of the flat parameter
buffer (kept alive until the send completes) and the weight as a 1-element float64 tensor.

Exact weights: a_i is an integer count of 2⁻⁵² units (exact in float64 on the wire), halving sends the
rounded-down half and keeps the rest, so Σ a_i is exactly 1.0 for every k and run length; for k a power of
two the initial 1/k is exact, otherwise the remainder units go to the first ranks.

Receiving: each rank keeps one posted receive per source (a params and a weight buffer each, so
O(ranks × params) memory) and re-posts it after consuming a message; receives match in posting order and
MPI never lets messages of one (source, tag) overtake each other, so the n-th params and n-th weight
message of a source belong together. A posted receive is also what lets a large (rendezvous-protocol)
send complete while the receiver is busy.

``finish()`` — termination without a collective: each rank sends every peer a *goodbye* (a negative
weight and a zero params buffer), which by the non-overtaking rule arrives after all its real messages;
it then polls and merges until every peer's goodbye is in (the goodbye consumes the posted receive, which
is not re-posted, so nothing dangles) and waits for its own sends, which every peer drains the same way.
Every rank reaches finish() after its last step and blocks on nothing before sending its goodbyes, so
every loop ends; ranks may even take different numbers of steps. No exchange of message counts (a
collective) is needed, and a rank blocked in one could not merge meanwhile. ``sync_state()`` (after finish,
collectives allowed) computes Σ a_i x_i with one allreduce; ``eval_params()`` returns it (None before).

Test hook: ``GOSGD(schedule=f)`` with ``f(step, rank) -> destination | None`` replaces the random draw,
and at step t each rank first waits for exactly the messages the schedule sent it at step t−1 (and
merges only those, in source order), so runs are deterministic even under real MPI. BatchNorm buffers are
not gossiped. Only one learner per rank is supported for now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..comm.base import Handle
from ..validate import setting
from .base import Rule
from .registry import RULES

log = logging.getLogger(__name__)

#: Gossip weights count units of 2⁻⁵²: the whole mass 1.0 is ``UNIT`` units, exact in float64.
UNIT = 2**52
TAG_PARAMS, TAG_WEIGHT = 4101, 4102
#: The test hook: (step, rank) -> destination rank or None.
Schedule = Callable[[int, int], int | None]


@RULES.register("GOSGD")
class GOSGD(Rule):
    """Gossip: with probability p per step, send half of one's weight and one's model to a random peer."""

    @dataclass(frozen=True)
    class Config:
        """GOSGD hyper-parameters."""

        p: float = setting(0.01, "probability of gossiping after a local step", gt=0, le=1)
        seed: int = setting(0, "seed of the peer draws (with the rank)", ge=0)

    name = "GOSGD"

    def __init__(self, schedule: Schedule | None = None, **hyper: Any) -> None:
        super().__init__(**hyper)
        self.schedule = schedule

    @property
    def synchronous(self) -> bool:
        """Ranks run at their own pace until finish()."""
        return False

    def on_bind(self) -> None:
        """Initial weight, the peer generator and one posted receive per source."""
        assert self.pool is not None and self.comm is not None
        if len(self.pool.learners) != 1:
            raise ValueError(f"GOSGD supports one learner per rank for now, got {len(self.pool.learners)}")
        self.x = self.pool.learners[0].params  # the learner's own weights, merged in place
        rank, size = self.rank, self.size = self.comm.rank, self.comm.size
        self.mass = UNIT // size + (rank < UNIT % size)
        self.rng = np.random.default_rng((self.hyper.seed, rank))
        self.steps, self.sent, self.received = 0, [0] * size, [0] * size
        self.finished = False
        self.average_params: torch.Tensor | None = None
        self.peers = [s for s in range(size) if s != rank]
        self.inbox = {
            s: (torch.empty_like(self.x), self.x.new_zeros(1, dtype=torch.float64)) for s in self.peers
        }
        self.posted: dict[int, tuple[Handle, Handle] | None] = {s: None for s in self.peers}
        for s in self.peers:
            self._post(s)
        self.outbox: list[tuple[Handle, Handle, torch.Tensor, torch.Tensor]] = []

    @property
    def weight(self) -> float:
        """a_i, this learner's gossip weight (exact)."""
        return self.mass / UNIT

    def _post(self, src: int) -> None:
        assert self.comm is not None
        x, a = self.inbox[src]
        self.posted[src] = (self.comm.irecv(x, src, TAG_PARAMS), self.comm.irecv(a, src, TAG_WEIGHT))

    def _take(self, src: int, wait: bool) -> bool:
        """Consume the next message from ``src`` if it is in (or wait for it); False if none or goodbye."""
        handles = self.posted[src]
        if handles is None:
            return False
        if wait:
            handles[0].wait()
            handles[1].wait()
        elif not (handles[1].test() and handles[0].test()):
            return False
        x_s, a_s = self.inbox[src]
        weight = float(a_s.item())
        if weight < 0:  # goodbye: no more messages from src, its receive is consumed and stays so
            self.posted[src] = None
            return False
        mass = int(weight * UNIT)
        self.x.add_(x_s - self.x, alpha=mass / (self.mass + mass))  # (a_i x_i + a_s x_s) / (a_i + a_s)
        self.mass += mass
        self.received[src] += 1
        self._post(src)
        return True

    def _merge_arrived(self) -> None:
        """Merge every message in, each source's in arrival order, sources in rank order."""
        for src in self.peers:
            while self._take(src, wait=False):
                pass

    def _await_scheduled(self, step: int) -> None:
        """Schedule mode: wait for and merge exactly what the schedule sent here at ``step``."""
        assert self.schedule is not None
        for src in self.peers:
            if step >= 0 and self.schedule(step, src) == self.rank:
                self._take(src, wait=True)

    def _send(self, dst: int, params: torch.Tensor, weight: float) -> None:
        assert self.comm is not None
        a = params.new_full((1,), weight, dtype=torch.float64)
        self.outbox.append(
            (self.comm.isend(params, dst, TAG_PARAMS), self.comm.isend(a, dst, TAG_WEIGHT), params, a)
        )

    def _destination(self, step: int) -> int | None:
        if self.schedule is not None:
            dst = self.schedule(step, self.rank)
            if dst is not None and (dst == self.rank or not 0 <= dst < self.size):
                raise ValueError(f"GOSGD schedule({step}, {self.rank}) = {dst} is not another rank")
            return dst
        if not self.peers or self.rng.random() >= self.hyper.p:
            return None
        return self.peers[int(self.rng.integers(len(self.peers)))]

    def exchange(self, step: int) -> None:
        """Merge what arrived, then gossip with probability p (or as the schedule says)."""
        if self.schedule is not None:
            self._await_scheduled(self.steps - 1)
        else:
            self._merge_arrived()
        self.outbox = [m for m in self.outbox if not (m[0].test() and m[1].test())]
        dst = self._destination(self.steps)
        self.steps += 1
        if dst is None:
            return
        half = self.mass // 2
        self.mass -= half
        self.sent[dst] += 1
        self._send(dst, self.x.clone(), half / UNIT)

    def finish(self) -> None:
        """Send goodbyes, merge until every peer's goodbye is in, wait for own sends (see module doc)."""
        if self.finished:
            return
        if self.schedule is not None:
            self._await_scheduled(self.steps - 1)
        goodbye = torch.zeros_like(self.x)
        for dst in self.peers:
            self._send(dst, goodbye, -1.0)
        while any(h is not None for h in self.posted.values()):
            self._merge_arrived()
            time.sleep(1e-4)
        for sent_params, sent_weight, *_ in self.outbox:
            sent_params.wait()
            sent_weight.wait()
        self.outbox, self.finished = [], True
        log.debug("GOSGD finished: weight %.6g, sent %s, received %s", self.weight, self.sent, self.received)

    def sync_state(self) -> None:
        """After finish: the weighted average Σ a_i x_i, one allreduce (Σ a_i = 1)."""
        assert self.comm is not None
        if not self.finished:
            raise RuntimeError("GOSGD.sync_state() needs finish() first: messages are still in flight")
        self.average_params = self.x.clone().mul_(self.weight)
        self.comm.allreduce(self.average_params).wait()

    def eval_params(self) -> torch.Tensor | None:
        """The weighted average after sync_state(); before it, None (this rank's own weights)."""
        return self.average_params

    def state_dict(self) -> dict[str, Any]:
        """Weight, generator state and counters; take it after finish(), which drains messages in flight."""
        return {
            **super().state_dict(),
            "mass": self.mass,
            "rng": self.rng.bit_generator.state,
            "steps": self.steps,
            "sent": list(self.sent),
            "received": list(self.received),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore weight, generator state and counters."""
        self.mass = int(state["mass"])
        self.rng.bit_generator.state = state["rng"]
        self.steps = int(state["steps"])
        self.sent, self.received = list(state["sent"]), list(state["received"])
