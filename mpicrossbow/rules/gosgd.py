"""GOSGD — gossip SGD (Blot, Picard, Cord, Thome 2016; Theano-MPI GOSGD). Asynchronous: no collectives.

Who sends what to whom, and when: every learner i (k in all: ranks × learners per rank, learner j of rank r
is global learner ``r·m + j``) keeps its weights x_i and a gossip weight a_i (initially 1/k). It takes its
optimizer's local step every step; then (``exchange``) every message that has arrived for it is merged,
``x_i ← (a_i x_i + a_s x_s) / (a_i + a_s)``, ``a_i ← a_i + a_s``, and with probability ``p`` it picks
another learner uniformly (a numpy generator seeded by ``(seed, rank)``), halves a_i and sends (x_i, a_i).
A message to a learner of the same rank is a snapshot queued in memory; a message to another rank is two
non-blocking point-to-point transfers, never pickled: a snapshot of the flat parameter buffer (kept alive
until the send completes) and ``[weight, destination learner]`` as a 2-element float64 tensor. Either kind
is merged at the receiver's next exchange.

Exact weights: a_i is an integer count of 2⁻⁵² units (exact in float64 on the wire), halving sends the
rounded-down half and keeps the rest, so Σ a_i is exactly 1.0 for every k and run length; for k a power of
two the initial 1/k is exact, otherwise the remainder units go to the first learners.

Receiving: each rank keeps one posted receive per source rank (a params and a weight buffer each, so
O(ranks × params) memory) and re-posts it after consuming a message; receives match in posting order and
MPI never lets messages of one (source, tag) overtake each other, so the n-th params and n-th weight
message of a source belong together. A posted receive is also what lets a large (rendezvous-protocol)
send complete while the receiver is busy.

``finish()`` — termination without a collective: each rank sends every peer rank a *goodbye* (a negative
weight and a zero params buffer), which by the non-overtaking rule arrives after all its real messages;
it then polls and merges until every peer's goodbye is in (the goodbye consumes the posted receive, which
is not re-posted, so nothing dangles), merges what its own learners queued for each other, and waits for
its own sends, which every peer drains the same way. Every rank reaches finish() after its last step and
blocks on nothing before sending its goodbyes, so every loop ends; ranks may even take different numbers of
steps. ``sync_state()`` (after finish, collectives allowed) computes Σ a_i x_i with one allreduce;
``eval_params()`` returns it (None before).

Elastic training (``[elastic] enabled``): a peer rank that dies is met by a receive posted from it or a send
to it (:class:`~mpicrossbow.comm.ulfm.PeerLost`, without revoking: the run is asynchronous). The rank then
forgets it — no receive is posted from it again, it is never drawn as a destination (the draw is among the
live learners), and no goodbye is awaited from it. The gossip weight it held, and what was on the way to or
from it, is lost; merging is a weighted mean, so the survivors' gossip goes on unchanged, and the final
model divides Σ a_i x_i by the survivors' Σ a_i (the survivors' weights renormalised to sum to one). After
``finish`` the survivors agree, shrink and :meth:`GOSGD.on_rebind` renumbers the peers.

Test hook: ``GOSGD(schedule=f)`` with ``f(step, learner) -> destination learner | None`` (global indices)
replaces the random draw, and at step t each learner first merges exactly the messages the schedule sent it
at step t−1, in source order, waiting for remote ones, so runs are deterministic even under real MPI.
BatchNorm buffers are not gossiped.
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
from ..config.fields import setting
from ..trace import instant
from .base import Rule
from .patience import Silence
from .peer_loss import Forgetting
from .registry import RULES

log = logging.getLogger(__name__)

#: Gossip weights count units of 2⁻⁵²: the whole mass 1.0 is ``UNIT`` units, exact in float64.
UNIT = 2**52
TAG_PARAMS, TAG_WEIGHT = 4101, 4102
#: The test hook: (step, global learner) -> destination global learner or None.
Schedule = Callable[[int, int], int | None]


@RULES.register("GOSGD")
class GOSGD(Rule):
    """Gossip: with probability p per step, a learner sends half its weight and its model to another."""

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
        """Initial weights, the peer generator and one posted receive per source rank."""
        assert self.pool is not None and self.comm is not None
        self.xs = [learner.params for learner in self.pool.learners]  # merged in place
        self.m = len(self.xs)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.k = self.size * self.m
        first = self.rank * self.m
        self.masses = [UNIT // self.k + (g < UNIT % self.k) for g in range(first, first + self.m)]
        self.rng = np.random.default_rng((self.hyper.seed, self.rank))
        self.steps, self.sent, self.received = 0, [0] * self.size, [0] * self.size
        self.finished = False
        self._awaited = -1
        self.average_params: torch.Tensor | None = None
        self._new_peers()
        for s in self.peers:
            self._post(s)
        log.info(
            "GOSGD: %d learner(s), gossip probability p = %g per step, peers drawn %s",
            self.k,
            self.hyper.p,
            "by the test schedule" if self.schedule is not None else f"with seed ({self.hyper.seed}, rank)",
        )
        #: Sends in flight: (params handle, weight handle, destination rank, params, meta) — the tensors
        #: kept alive until the sends complete.
        self.outbox: list[tuple[Handle, Handle, int, torch.Tensor, torch.Tensor]] = []
        #: Messages between learners of this rank: (source learner, destination j, snapshot, mass).
        self.local: list[tuple[int, int, torch.Tensor, int]] = []

    def _new_peers(self) -> None:
        """Every other rank is a peer, none lost, with a receive buffer each and none posted yet."""
        self.peers = [s for s in range(self.size) if s != self.rank]
        #: Peer ranks lost for good (elastic training): forgotten, never waited for or drawn again.
        self.lost: set[int] = set()
        x = self.xs[0]
        self.inbox = {s: (torch.empty_like(x), x.new_zeros(2, dtype=torch.float64)) for s in self.peers}
        self.posted: dict[int, tuple[Handle, Handle] | None] = {s: None for s in self.peers}

    @property
    def mass(self) -> int:
        """Σ a_i over this rank's learners, in units of 2⁻⁵²."""
        return sum(self.masses)

    @property
    def weight(self) -> float:
        """Σ a_i over this rank's learners (exact)."""
        return self.mass / UNIT

    def _post(self, src: int) -> None:
        assert self.comm is not None
        x, meta = self.inbox[src]
        with Forgetting(src, self._forget):
            self.posted[src] = (self.comm.irecv(x, src, TAG_PARAMS), self.comm.irecv(meta, src, TAG_WEIGHT))

    def _forget(self, peer: int) -> None:
        """Peer rank ``peer`` was lost (elastic training): stop receiving from it and drawing it."""
        self.posted[peer] = None
        if peer in self.lost:
            return
        self.lost.add(peer)
        log.info(  # every survivor meets the loss; rank 0's line is the one printed
            "GOSGD rank %d: rank %d was lost (met at step %d, after %d message(s) from it); "
            "gossiping on with %d other rank(s)",
            self.rank,
            peer,
            self.steps,
            self.received[peer],
            len(self.peers) - len(self.lost),
        )

    @staticmethod
    def _done(handle: Handle, wait: bool) -> bool:
        """Whether ``handle`` completed (``wait``: block until it has)."""
        if wait:
            handle.wait()
            return True
        return handle.test()

    def _merge(self, j: int, x_s: torch.Tensor, mass: int) -> None:
        """x_j ← (a_j x_j + a_s x_s) / (a_j + a_s); a_j ← a_j + a_s."""
        self.xs[j].add_(x_s - self.xs[j], alpha=mass / (self.masses[j] + mass))
        self.masses[j] += mass

    def _take(self, src: int, wait: bool) -> int | None:
        """Merge the next message from ``src`` if in (or wait for it): its learner, or None (none/goodbye)."""
        handles = self.posted[src]
        if handles is None:
            return None
        with Forgetting(src, self._forget) as met:
            arrived = self._done(handles[1], wait) and self._done(handles[0], wait)
        if met.lost or not arrived:
            return None
        x_s, meta = self.inbox[src]
        weight, j = meta.tolist()
        if weight < 0:  # goodbye: no more messages from src, its receive is consumed and stays so
            self.posted[src] = None
            return None
        self._merge(int(j), x_s, int(weight * UNIT))
        instant("gossip merge", "gossip", source_rank=src, learner=int(j), weight=weight)
        self.received[src] += 1
        self._post(src)
        return int(j)

    def _merge_local(self, only: Callable[[int, int], bool] = lambda src, j: True) -> None:
        """Merge the queued messages between this rank's learners (in source order) that ``only`` picks."""
        keep = []
        for src, j, x_s, mass in sorted(self.local, key=lambda msg: msg[0]):
            if only(src, j):
                self._merge(j, x_s, mass)
                self.received[self.rank] += 1
            else:
                keep.append((src, j, x_s, mass))
        self.local = keep

    def _merge_arrived(self) -> None:
        """Merge every message in: each source rank's in arrival order, then this rank's own."""
        for src in self.peers:
            while self._take(src, wait=False) is not None:
                pass
        self._merge_local()

    def _await_scheduled(self, step: int) -> None:
        """Schedule mode: merge exactly what the schedule sent here at ``step``, in source order."""
        assert self.schedule is not None
        if step < 0 or step == self._awaited:
            return
        self._awaited = step  # finish() may await the last step's messages before exchange() would
        mine = range(self.rank * self.m, (self.rank + 1) * self.m)
        for g in range(self.k):
            dst = self.schedule(step, g)
            if dst not in mine:
                continue
            src = g // self.m
            if src == self.rank:
                self._merge_local(lambda s, j, g=g: s == g)
            else:
                j = self._take(src, wait=True)
                if j != dst - self.rank * self.m:
                    raise RuntimeError(f"GOSGD schedule: expected a message for learner {dst}, got {j}")

    def _send(self, dst: int, params: torch.Tensor, weight: float, j: int) -> None:
        assert self.comm is not None
        meta = params.new_tensor([weight, float(j)], dtype=torch.float64)
        if weight >= 0:
            instant("gossip send", "gossip", to_rank=dst, learner=j, weight=weight)
        with Forgetting(dst, self._forget) as met:  # what was sent is lost with the peer
            handles = (self.comm.isend(params, dst, TAG_PARAMS), self.comm.isend(meta, dst, TAG_WEIGHT))
        if not met.lost:
            self.outbox.append((*handles, dst, params, meta))

    def _sent(self, msg: tuple[Handle, Handle, int, torch.Tensor, torch.Tensor], wait: bool) -> bool:
        """Whether the outbox message ``msg`` is done with: delivered, or its destination lost."""
        with Forgetting(msg[2], self._forget):
            return self._done(msg[0], wait) and self._done(msg[1], wait)
        return True

    def _destination(self, step: int, g: int) -> int | None:
        """Global learner that learner ``g`` gossips to at ``step``, or None."""
        if self.schedule is not None:
            dst = self.schedule(step, g)
            if dst is not None and (dst == g or not 0 <= dst < self.k):
                raise ValueError(f"GOSGD schedule({step}, {g}) = {dst} is not another learner")
            return dst
        if self.k == 1 or self.rng.random() >= self.hyper.p:
            return None
        if not self.lost:
            other = int(self.rng.integers(self.k - 1))
            return other + (other >= g)
        live = [h for h in range(self.k) if h != g and h // self.m not in self.lost]
        return live[int(self.rng.integers(len(live)))] if live else None

    def exchange(self, step: int) -> None:
        """Merge what arrived, then every learner gossips with probability p (or as the schedule says)."""
        if self.schedule is not None:
            self._await_scheduled(self.steps - 1)
        else:
            self._merge_arrived()
        self.outbox = [msg for msg in self.outbox if not self._sent(msg, wait=False)]
        for j in range(self.m):
            g = self.rank * self.m + j
            dst = self._destination(self.steps, g)
            if dst is None:
                continue
            half = self.masses[j] // 2
            self.masses[j] -= half
            to_rank, to_j = divmod(dst, self.m)
            self.sent[to_rank] += 1
            if to_rank == self.rank:
                self.local.append((g, to_j, self.xs[j].clone(), half))
            else:
                self._send(to_rank, self.xs[j].clone(), half / UNIT, to_j)
        self.steps += 1

    def finish(self) -> None:
        """Send goodbyes, merge until every peer's goodbye is in, wait for own sends (see module doc)."""
        if self.finished:
            return
        if self.schedule is not None:
            self._await_scheduled(self.steps - 1)
        goodbye = torch.zeros_like(self.xs[0])
        for dst in self.peers:
            if dst not in self.lost:
                self._send(dst, goodbye, -1.0, 0)
        live = [s for s in self.peers if s not in self.lost]
        silence = Silence(self.patience, f"GOSGD rank {self.rank}", "for the goodbye", live)
        while any(h is not None for h in self.posted.values()):
            self._merge_arrived()
            silence.check(s for s, h in self.posted.items() if h is not None)
            time.sleep(1e-4)
        self._merge_local()
        for msg in self.outbox:
            self._sent(msg, wait=True)
        self.outbox, self.finished = [], True
        log.debug("GOSGD finished: weight %.6g, sent %s, received %s", self.weight, self.sent, self.received)

    def rearm(self) -> None:
        """After a snapshot: post a receive per peer again (the goodbyes consumed them) and gossip on."""
        self.finished, self.average_params = False, None
        for s in self.peers:
            if s not in self.lost:
                self._post(s)

    @property
    def in_flight(self) -> int:
        """Posted receives, sends not yet completed and queued in-memory messages."""
        posted = sum(2 for handles in self.posted.values() if handles is not None)
        return posted + 2 * len(self.outbox) + len(self.local)

    def sync_state(self) -> None:
        """After finish: the weighted average Σ a_i x_i / Σ a_i, two allreduces (Σ a_i is exactly 1 unless
        elastic training lost a rank's weight)."""
        assert self.comm is not None
        if not self.finished:
            raise RuntimeError("GOSGD.sync_state() needs finish() first: messages are still in flight")
        total = torch.zeros_like(self.xs[0])
        for x, mass in zip(self.xs, self.masses, strict=True):
            total.add_(x, alpha=mass / UNIT)
        self.comm.exact.allreduce(total).wait()  # the model to validate: never compressed
        (weight,) = self.comm.exact.allreduce_scalars([self.weight])  # exact: multiples of 2⁻⁵², at most 1
        if weight != 1.0:
            total.div_(weight)
        self.average_params = total

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """After ``finish`` (asynchronous ranks meet only then): the peers, counters and learner numbering
        follow the survivors, renumbered in rank order; every peer was forgotten or said goodbye already."""
        assert self.comm is not None
        keep = [r for r in range(self.size) if r not in lost]
        self.sent = [self.sent[r] for r in keep]
        self.received = [self.received[r] for r in keep]
        self.rank, self.size = self.comm.rank, self.comm.size
        self.k = self.size * self.m
        self._new_peers()

    def eval_params(self) -> torch.Tensor | None:
        """The weighted average after sync_state(); before it, None (this rank's own weights)."""
        return self.average_params

    def state_dict(self) -> dict[str, Any]:
        """Weights, generator state and counters; take it after finish(), which drains messages in flight."""
        return {
            **super().state_dict(),
            "masses": list(self.masses),
            "rng": self.rng.bit_generator.state,
            "steps": self.steps,
            "sent": list(self.sent),
            "received": list(self.received),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore weights, generator state and counters."""
        masses = [int(m) for m in state["masses"]]
        if len(masses) != self.m:
            raise ValueError(f"GOSGD state has {len(masses)} learner(s), this rank has {self.m}")
        self.masses = masses
        self.rng.bit_generator.state = state["rng"]
        self.steps = int(state["steps"])
        self.sent, self.received = list(state["sent"]), list(state["received"])
