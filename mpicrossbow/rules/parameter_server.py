"""The parameter-server substrate: server ranks hold the global model, workers push deltas and pull it back.

Who sends what to whom, and when (SpeeDO's async mode, MXNet-G's ``dist_async``/``dist_ssync``, Ho et al.'s
SSP): ranks ``0..S-1`` serve (``[rule] servers = S``, default 1) and do not train; workers are ranks
``S..N-1`` and share the training data. With several servers the model is **sharded by parameter ranges**:
server j holds the j-th of S near-equal contiguous slices of the flat parameters (``numpy.array_split``
bounds) and a worker talks to every server. Every τ local steps a worker sends each server its slice of
``Δ = Σ_i (x_i − x_pulled)`` (the progress of its m learners since it last pulled: one message, as m
workers would send) with a non-blocking send, and waits for the replies, the servers' current w, which every
learner adopts (``x_i ← w``, ``x_pulled ← w``).

A server keeps **one posted receive per worker** and serves each push as it arrives: ``w ← w + scale ·
weight · Δ`` (weight is 1 except for GSP's staleness weight) and the worker's clock (its pushes) goes up by
one. It replies at once unless its policy holds the reply (SSP's staleness bound, SpeeDO's partial
synchrony) or discards the push (weed-out). Every server applies the policy to its own shard with its own
counters; a worker pushes to all servers at every push, so their clocks agree.

Messages: a push is ``[Δ slice, stats, flag, progress, seen, number]`` — stats the mean of the worker's
learners' BatchNorm buffers (S = 1 only, :mod:`~mpicrossbow.rules.served_stats`: the served model is
validated with them), flag UPDATE or DONE, progress in epochs (drives the once-per-epoch report of the served
model, S = 1 only), seen = the server's update count in the reply the worker last adopted (GSP's staleness),
number = the push's number among the worker's pushes (a DONE: how many it made). A push whose number the
worker's clock already counts was sent again to a backup that took over (:mod:`.server_backup`): it is
answered, never applied twice; a DONE whose count differs from the clock is said in the server's last line.
A reply is ``[w slice, updates, confirmed]`` — confirmed: how many of the worker's pushes the server's backup
has acknowledged (all, without a backup), the others being pushes the worker keeps to send again.

Placement (``[rule] placement``): ``rank`` as above; ``colocated``: every rank trains and hosts shard r of N
in a background thread (:mod:`~mpicrossbow.rules.server_thread`) on a communicator split off the rule's —
the pushes and replies then travel there, and a worker pushes to every rank's shard, its own included.

Termination as in asynchronous EASGD: a worker's last message (flag DONE) says done; a done worker no longer
counts for c_min, and a server leaves :meth:`ParameterServer.serve` once every worker is done, no reply waits
and every reply send has completed: nothing is in flight.

Elastic training (``[elastic] enabled``, ASGD and SSP with server ranks): a receive from or reply to a worker
that died raises :class:`~mpicrossbow.comm.ulfm.PeerLost`; the server forgets that worker
(:meth:`ParameterServer.forget`: done for good, out of c_min) and serves the others on. A lost server ends
the job: the model lives there — unless it has a backup (``[elastic] server_backups = 1``,
:mod:`.server_backup`), which mirrors its state message by message and serves on in its place.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal

import torch

from ..comm.base import Communicator, DoneHandle, Handle
from ..config.fields import setting
from ..errors import ConfigError
from ..trace import instant, span
from .base import Rule, not_forgetting
from .patience import Patience, Silence, wait_for
from .peer_loss import Forgetting, Rerouted, server_lost
from .request_loop import DONE, UPDATE, Order, Report, serve_requests
from .served_stats import ServedStats, learners_mean_buffers
from .server_backup import (
    DONE_ACK_TAG,
    FORGOTTEN,
    HANDLED,
    NOTICE_TAG,
    Mirror,
    Routes,
    backup_ranks,
    mirror_until_done,
)
from .server_thread import ServerThread

log = logging.getLogger(__name__)

#: What a worker says after a lost parameter server, when it ends the job.
SERVER_LOST = (
    "the model lives on the server ranks, so the job ends (elastic training survives lost workers only)"
)

PUSH_TAG, PULL_TAG = 7201, 7202
#: A server's counters that a checkpoint keeps: per worker, and in all.
SERVER_COUNTS_PER_WORKER = ("clock", "seen", "pulled_at", "progress")
SERVER_COUNTS = ("updates", "received", "discarded", "holds")
#: Values after the Δ slice in a push (flag, progress, seen, number) and after the w slice in a reply
#: (updates, confirmed: the worker's pushes the server's backup holds, or all of them).
PUSH_HEADER, REPLY_HEADER = 4, 2


def shard_bounds(numel: int, servers: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each server's slice of ``numel`` values: contiguous, near-equal, the first
    ``numel mod servers`` slices one longer (``numpy.array_split``'s convention)."""
    base, extra = divmod(numel, servers)
    edges = [j * base + min(j, extra) for j in range(servers + 1)]
    return list(itertools.pairwise(edges))


class Policy:
    """When the server merges a push, with what weight, and when it replies: ASGD's answer is always, 1, now.

    Subclasses (SSP's staleness bound, SpeeDO's partial synchrony and weed-out, GSP's staleness weight)
    override the questions they answer differently.
    """

    def accept(self, server: ParameterServer, r: int) -> bool:
        """Merge worker r's push (True) or discard it (False: r restarts from w)."""
        return True

    def weight(self, server: ParameterServer, r: int) -> float:
        """Factor on worker r's push, on top of ``scale`` (``server.seen[r]`` holds the push's seen count)."""
        return 1.0

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
    """A server rank's loop over its slice ``w``: apply each push as it arrives, reply (unless held)."""

    def __init__(
        self,
        comm: Communicator,
        w: torch.Tensor,
        scale: float,
        policy: Policy,
        order: Order | None,
        workers: list[int],
        stats_size: int = 0,
        rescale: bool = False,
        acks_done: bool = False,
    ) -> None:
        self.comm, self.w, self.scale, self.policy, self.order = comm, w, scale, policy, order
        self.workers = workers
        #: ``scale`` is 1 / the workers' learners (``[rule] scale = 0``): it follows the workers left.
        self.rescale = rescale
        #: Workers lost for good (elastic training): forgotten, never waited for again.
        self.lost: set[int] = set()
        #: The workers' latest BatchNorm buffers, carried by their pushes (``stats_size`` values each).
        self.stats = ServedStats(stats_size)
        n = w.numel()
        self._inbox = {r: w.new_zeros(n + stats_size + PUSH_HEADER) for r in self.workers}
        self._outbox = {r: w.new_zeros(n + REPLY_HEADER) for r in self.workers}
        self._recvs: dict[int, Handle] = {}
        self._sends: dict[int, Handle] = {}
        self.clock = dict.fromkeys(self.workers, 0)
        self.progress: dict[int, float] = {}
        #: The update count each worker's latest push was computed from (GSP's staleness).
        self.seen = dict.fromkeys(self.workers, 0)
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
        #: The weights pushes were applied with (GSP's 1/Y), in order.
        self.weights: list[float] = []
        self._reported = 0
        #: Where each event goes before any reply (a server with a backup, :mod:`.server_backup`).
        self.mirror: Mirror | None = None
        #: A backup before its takeover: events come from its server, no reply goes out.
        self.shadowing = False
        #: A backup that took over from its lost server.
        self.took_over = False
        #: Backups on: a DONE is acknowledged (a worker must know whether to say it again to the backup).
        self.acks_done = acks_done
        #: Pushes received again after a takeover, already applied: answered, not applied.
        self.resent = 0
        #: Workers whose DONE counted other pushes than this server did: worker -> (theirs, ours).
        self.miscounted: dict[int, tuple[int, int]] = {}
        self.patience = Patience()
        self._done_ack = w.new_zeros(1)

    @property
    def message_size(self) -> int:
        """The values of one push: the Δ slice, the BatchNorm statistics and the header."""
        return self.w.numel() + self.stats.size + PUSH_HEADER

    def all_done(self) -> bool:
        """Whether every worker said DONE or was lost."""
        return all(r in self.done for r in self.workers)

    @property
    def in_flight(self) -> int:
        """Posted receives, held replies and unfinished reply sends (0 after :meth:`serve`)."""
        return len(self._recvs) + len(self._sends) + len(self.held)

    def c_min(self) -> int:
        """The slowest clock among workers still training (∞ when all are done)."""
        active = [self.clock[r] for r in self.workers if r not in self.done]
        return min(active) if active else math.inf  # type: ignore[return-value]

    def serve(
        self,
        report: Report | None,
        tick: Callable[[], None] | None = None,
        patience: Patience | None = None,
        resume: bool = False,
    ) -> None:
        """Serve pushes until every worker is done and nothing is in flight; ``report`` once per epoch.
        Served again after a snapshot, it starts with every worker training again (``resume``: a backup's
        takeover, the workers done stay done). A worker neither done nor waiting for a held reply that stays
        silent is a stall (``patience``)."""
        self.patience = patience or Patience()
        if self.mirror is not None:
            self.mirror.patience = self.patience
        if not resume:
            self.done = set(self.lost)
        for r in self.workers:
            if r not in self.done:
                self._recvs[r] = self.comm.irecv(self._inbox[r], r, PUSH_TAG)
        silence = Silence(
            patience or Patience(), f"parameter server rank {self.comm.rank}", "for a push", self.workers
        )
        serve_requests(
            self._recvs, lambda r: self._handle(r, report), self.order, self._sends, tick, silence,
            lambda: [r for r in self.workers if r not in self.done and r not in self.held], self.forget,
        )  # fmt: skip
        log.info("parameter server rank %d: %d update(s) from %d worker(s), all done%s", self.comm.rank,
                 self.updates, len(self.workers), self.accounting())  # fmt: skip

    def accounting(self) -> str:
        """How the workers' pushes were counted, for the server's last line: each applied once, or which
        worker's count differs (and the resends a takeover answered without applying them)."""
        resent = f"; {self.resent} push(es) sent again after a takeover answered, not applied" * bool(
            self.resent
        )
        if self.miscounted:
            counts = ", ".join(
                f"worker {r} made {a}, counted {b}" for r, (a, b) in sorted(self.miscounted.items())
            )
            return f"; PUSHES MISCOUNTED: {counts}{resent}"
        said = [r for r in self.workers if r not in self.lost]
        return f"; every push of the {len(said)} finishing worker(s) counted once{resent}"

    def _handle(self, r: int, report: Report | None) -> None:
        del self._recvs[r]
        msg = self._inbox[r]
        self._event(r, msg)
        if float(msg[self.w.numel() + self.stats.size]) == DONE and self.acks_done:
            with Forgetting(r, self.forget):
                if r in self._sends:
                    self._sends.pop(r).wait()
                self._sends[r] = self.comm.isend(self._done_ack, r, DONE_ACK_TAG)
        # Mean progress of the workers heard from (GSP: only group leaders push before the end).
        epoch = sum(self.progress.values()) / max(len(self.progress), 1)
        if report is not None and math.floor(epoch) > self._reported:
            self._reported = math.floor(epoch)
            report(self.w, epoch)

    def _event(self, r: int, msg: torch.Tensor) -> None:
        """Worker ``r``'s message ``msg`` applied, mirrored to the backup (if any), and the replies that may
        go out now sent."""
        fresh = self._take(r, msg)
        if self.mirror is not None:
            head = self.w.numel() + self.stats.size
            done = float(msg[head]) == DONE
            self.mirror.forward(r, msg, HANDLED, 0 if done else int(msg[head + 3]), settle=done)
        self._release()
        if fresh and r in self.held:
            self.holds += 1

    def replay(self, r: int, msg: torch.Tensor) -> None:
        """A backup applies its server's event: the same state change, no reply sent."""
        self._event(r, msg)

    def _take(self, r: int, msg: torch.Tensor) -> bool:
        """The state change of worker ``r``'s message: True for a push applied (or discarded) now."""
        n = self.w.numel()
        head = n + self.stats.size
        flag, number = float(msg[head]), int(msg[head + 3])
        if flag != DONE and number <= self.clock[r]:  # sent again to a backup that took over: answered once
            self.resent += 1
            if r not in self.held:
                self.held.append(r)
            return False
        self.progress[r] = float(msg[head + 1])
        self.seen[r] = int(msg[head + 2])
        self.stats.record(r, msg[n:head])
        if flag == DONE:
            if number != self.clock[r]:
                self.miscounted[r] = (number, self.clock[r])
            self.done.add(r)
            instant("done", "message", worker=r)
            return False
        instant("push", "message", worker=r)
        self.received += 1
        if self.policy.accept(self, r):
            weight = self.policy.weight(self, r)
            self.w.add_(msg[:n], alpha=self.scale * weight)
            self.weights.append(weight)
            self.updates += 1
        else:
            self.discarded += 1
        self.clock[r] += 1
        self.policy.hold(self, r)
        self.held.append(r)
        return True

    def confirmed(self, r: int) -> int:
        """How many of worker ``r``'s pushes the backup holds: all, without one (or once it is lost)."""
        if self.mirror is not None:
            held = self.mirror.confirmed(r)
            if not self.mirror.lost:
                return held
        return self.clock[r]

    def take_over(self, server: int) -> None:
        """A backup whose server ``server`` was lost serves from now on: one line, and a notice to every live
        worker of what it holds of it (its pushes counted, whether its DONE arrived), which a worker that
        said DONE to the lost server reads to know whether to say it again."""
        self.shadowing, self.took_over = False, True
        log.warning(
            "backup rank %d: parameter server rank %d was lost; serving its shard from here (%d update(s) "
            "mirrored; the workers send again the pushes it lacks)",
            self.comm.rank, server, self.updates,
        )  # fmt: skip
        notice = torch.zeros(2, dtype=torch.float64)
        for r in self.workers:
            if r in self.lost:
                continue
            notice[0], notice[1] = self.clock[r], float(r in self.done)
            with Forgetting(r, self.forget):
                self.comm.isend(notice, r, NOTICE_TAG).wait()

    def _release(self) -> None:
        """Reply to every held worker within the staleness bound, then re-post its receive (a worker found
        lost on the way is forgotten)."""
        n = self.w.numel()
        for r in [r for r in self.held if self.policy.releasable(self, r)]:
            if r not in self.held:  # released (or forgotten) by a nested release, from forget()
                continue
            self.held.remove(r)
            self.pulled_at[r] = self.received
            if self.shadowing:  # the server sent it
                continue
            with Forgetting(r, self.forget) as met:
                if r in self._sends:
                    self._sends.pop(r).wait()
                self._outbox[r][:n].copy_(self.w)
                self._outbox[r][n] = self.updates
                self._outbox[r][n + 1] = self.confirmed(r)
                self._sends[r] = self.comm.isend(self._outbox[r], r, PULL_TAG)
                self._recvs[r] = self.comm.irecv(self._inbox[r], r, PUSH_TAG)
            if met.lost:
                continue
            instant("reply", "message", worker=r, updates=self.updates)

    def forget(self, r: int) -> None:
        """Worker ``r`` was lost (elastic training: a receive from it or a reply to it met its death). Its
        receive and reply are dropped, never waited for; it counts as done, so the server neither waits for
        it (stall detection, the end of serving) nor counts it in SSP's slowest clock — the replies it held
        back go out now; with ``[rule] scale = 0`` the survivors' pushes weigh 1 / their learners. The
        others are served on."""
        if r in self.lost:
            return
        live = len(self.workers) - len(self.lost)
        self.lost.add(r)
        self.done.add(r)
        self._recvs.pop(r, None)
        self._sends.pop(r, None)
        if r in self.held:
            self.held.remove(r)
        self.progress.pop(r, None)
        if self.rescale and live > 1:
            self.scale *= live / (live - 1)
        if not self.shadowing:
            log.warning(
                "parameter server rank %d: worker rank %d was lost after %d push(es); serving the %d "
                "other(s)", self.comm.rank, r, self.clock[r], live - 1,
            )  # fmt: skip
        if self.mirror is not None:
            self.mirror.forward(r, None, FORGOTTEN, 0, settle=True)
        self._release()


@dataclass(frozen=True)
class ServerConfig:
    """Hyper-parameters every parameter-server rule has; a rule's own ``Config`` subclasses this one."""

    tau: int = setting(1, "push Δ and pull w every τ local steps", ge=1)
    scale: float = setting(0.0, "the server applies w ← w + scale·Δ (0: 1 / all workers' learners)", ge=0)
    servers: int = setting(1, "ranks 0..servers-1 serve a shard of the model each (placement = rank)", ge=1)
    placement: Literal["rank", "colocated"] = setting(
        "rank",
        "rank: ranks 0..servers-1 serve and do not train; colocated: every rank trains and serves one shard "
        "of the model from a background thread (needs MPI_THREAD_MULTIPLE)",
    )


class ServerRule(Rule):
    """Base of the parameter-server rules: ranks 0..S-1 serve, the others push every τ steps and pull."""

    Config = ServerConfig
    #: Whether the rule's servers can forget a lost worker and serve the others on (elastic training): its
    #: policy follows the workers left. ASGD (no policy) and SSP (the slowest clock among the live) can.
    forgets_workers: ClassVar[bool] = False

    def policy(self) -> Policy:
        """When the server merges and replies (asynchronous SGD: always, at once)."""
        return Policy()

    def shard_policy(self, shard: int) -> Policy:
        """The policy of shard ``shard``: the rule's own on every shard, since its decisions depend on the
        workers' push counts alone, which every shard sees alike."""
        return self.policy()

    def __init__(self, order: Order | None = None, **hyper: Any) -> None:
        super().__init__(**hyper)
        self.order = order
        #: This rank's server when it serves instead of training (placement = rank).
        self.server: ParameterServer | None = None
        #: The shard this training rank serves, and the thread it serves it from (placement = colocated).
        self.shard: ParameterServer | None = None
        self.hosted: ServerThread | None = None
        #: A backup rank: the shard whose server it mirrors (None elsewhere).
        self.mirrored: int | None = None
        #: A worker's routes to the servers, and to their backups once lost.
        self.routes: Routes | None = None
        #: The rank holding each shard's w at the end (the server, or its backup after a takeover).
        self.roots: list[int] = []
        #: The world's size when bound (roles are by start rank: ``trains``, the backups).
        self.start_size = 0
        self._steps = 0
        self._synced = False

    @property
    def hosted_server(self) -> ParameterServer | None:
        """The server state this rank holds: a server rank's, or a colocated rank's shard (None: a worker
        of placement = rank)."""
        return self.server or self.shard

    @property
    def colocated(self) -> bool:
        """Every rank trains and serves a shard from a thread (``[rule] placement = colocated``)."""
        return bool(self.hyper.placement == "colocated")

    @property
    def needs_mpi_threads(self) -> bool:
        """A colocated shard's thread talks MPI beside the training thread: MPI_THREAD_MULTIPLE."""
        return self.colocated

    @property
    def synchronous(self) -> bool:
        """Ranks progress at their own pace until ``finish()``."""
        return False

    @property
    def servers(self) -> int:
        """S: the ranks that serve instead of training (0 when colocated)."""
        return 0 if self.colocated else int(self.hyper.servers)

    @property
    def backups(self) -> int:
        """Backup ranks per server rank (``[elastic] server_backups``): 0 or 1."""
        return 0 if self.colocated else int(self.server_backups)

    def backup_ranks(self, size: int) -> list[int]:
        """The backup rank of each server (the last S ranks), or none."""
        return backup_ranks(self.servers, size) if self.backups else []

    def model_survives(self, lost: set[int]) -> bool:
        """Each shard is held while its server or its backup lives."""
        backups = self.backup_ranks(self.start_size)
        return bool(backups) and all(j not in lost or backups[j] not in lost for j in range(self.servers))

    def backups_obstacle(self) -> str | None:
        """A server rank's state can be mirrored to a backup when the rule's servers forget lost workers
        (the backup serves the survivors on) and serve from ranks of their own."""
        if not self.forgets_workers:
            return not_forgetting(self.name)
        if self.colocated:
            return "placement = colocated keeps no server rank to back up; use placement = rank"
        return None

    @property
    def shards(self) -> int:
        """How many shards the server state is cut into: one per server rank, or per rank when colocated."""
        assert self.comm is not None
        return self.comm.size if self.colocated else self.servers

    def _check(self, size: int) -> None:
        if self.colocated and self.hyper.servers != 1:
            raise ConfigError(
                f"RULE={self.name}: [rule] placement = colocated serves one shard of the model on every "
                f"rank; [rule] servers = {self.hyper.servers} places server ranks (placement = rank): "
                "leave it at 1"
            )
        keep = self.servers * (1 + self.backups)
        if size < keep + 1:
            backed = f" and {self.servers} back them up ([elastic] server_backups)" if self.backups else ""
            raise ConfigError(
                f"RULE={self.name} needs at least {keep + 1} ranks ([rule] servers = {self.servers} "
                f"serve the model{backed}, at least one more rank trains); this job has {size}"
            )

    def elastic_obstacle(self, snapshots: bool = False) -> str | None:
        """``[elastic] enabled``: a rule whose servers forget lost workers, with server ranks (placement =
        rank). Colocated shards are not: a lost rank takes its shard of the model with it."""
        if not self.forgets_workers:
            return not_forgetting(self.name)
        if self.colocated:
            return (
                f"RULE={self.name} with [rule] placement = colocated cannot forget a lost rank: its shard of "
                "the model goes with it; use placement = rank"
            )
        return super().elastic_obstacle(snapshots)

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """After the serving ended (asynchronous ranks meet only then): the servers forgot the lost workers
        as they met them (:meth:`ParameterServer.forget`); what moves is where each shard's w is — its
        server, or its backup when the server was lost — in the survivors' numbering."""
        backups = self.backup_ranks(self.start_size)
        start = self.roots or list(range(self.shards))
        held = [backups[j] if root in lost and backups else root for j, root in enumerate(start)]
        self.roots = [r - sum(1 for gone in lost if gone < r) for r in held]

    def trains(self, rank: int, size: int) -> bool:
        """Every rank but the server ranks and their backups trains (every rank, when colocated)."""
        self._check(size)
        return self.servers <= rank < size - self.servers * self.backups

    def train_shard(self, rank: int, size: int) -> tuple[int, int]:
        """The workers share the data: shard rank − S of N − S (− S backups)."""
        self._check(size)
        return rank - self.servers, size - self.servers * (1 + self.backups)

    @property
    def workers(self) -> list[int]:
        """The training ranks S..N-1 (..N-S-1 with backups), in the start numbering."""
        assert self.comm is not None
        size = self.start_size or self.comm.size
        return list(range(self.servers, size - self.servers * self.backups))

    def scale(self) -> float:
        """The factor a push is applied with (``[rule] scale``; 0 means 1 / learners over all workers)."""
        assert self.pool is not None
        return self.hyper.scale or 1.0 / (len(self.workers) * len(self.pool.learners))

    def on_bind(self) -> None:
        """Server j: its slice of w. Worker: w, x_pulled and one push/reply buffer per server."""
        assert self.pool is not None and self.comm is not None
        self._check(self.comm.size)
        self.start_size = self.comm.size
        self.w = self.pool.learners[0].params.clone()
        self.bounds = shard_bounds(self.w.numel(), self.shards)
        rank, backups = self.comm.rank, self.backup_ranks(self.comm.size)
        #: The communicator of pushes and replies: a plain copy of the rule's for colocated shards.
        self.ps = self.comm.split(0) if self.colocated else self.comm
        if self.colocated:
            lo, hi = self.bounds[rank]
            shard = ParameterServer(
                self.ps,
                self.w[lo:hi].clone(),
                self.scale(),
                self.shard_policy(rank),
                self.order,
                self.workers,
            )
            self.shard = shard
            # started at this rank's first exchange
            self.hosted = ServerThread(lambda: shard.serve(None, None, self.patience), rank)
        elif rank < self.servers or rank in backups:
            shard = rank if rank < self.servers else backups.index(rank)
            lo, hi = self.bounds[shard]
            self.server = server = ParameterServer(
                self.comm, self.w[lo:hi], self.scale(), self.shard_policy(shard), self.order, self.workers,
                self._stats_size(shard), rescale=not self.hyper.scale, acks_done=bool(backups),
            )  # fmt: skip
            if rank in backups:
                self.mirrored, server.shadowing = shard, True
            elif backups:  # the mirror travels uncompressed: the backup applies what the server applied
                server.mirror = Mirror(self.comm.exact, backups[shard], server.message_size, self.w)
            return
        if backups:
            self.routes = Routes(self.comm, self.servers, backups, f"worker rank {rank}", rank - self.servers)
        self.pulled = self.w.clone()
        self.delta = torch.zeros_like(self.w)
        self.seen = [0] * self.shards
        self.pushes = [
            self.w.new_zeros(hi - lo + self._stats_size(j) + PUSH_HEADER)
            for j, (lo, hi) in enumerate(self.bounds)
        ]
        self.replies = [self.w.new_zeros(hi - lo + REPLY_HEADER) for lo, hi in self.bounds]
        self.acks = [self.w.new_zeros(1) for _ in self.bounds]
        #: Per shard, the pushes (number, message) its server's backup has not acknowledged yet.
        self.unconfirmed: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.bounds]
        self.requests = 0
        self._resends: list[Handle] = []

    def _stats_size(self, server: int) -> int:
        """BatchNorm values a push to ``server`` carries: the float buffers' count for the one server that
        reports the served model mid-run (S = 1), else 0."""
        assert self.pool is not None
        return self.pool.learners[0].buffers.numel() if self.shards == 1 and server == 0 else 0

    def _progress(self) -> float:
        assert self.pool is not None
        return self._steps / self.pool.n_batch_train

    def _compute_delta(self) -> None:
        """``delta ← Σ_i (x_i − x_pulled)`` over this rank's learners."""
        assert self.pool is not None
        learners = self.pool.learners
        torch.sub(learners[0].params, self.pulled, out=self.delta)
        for learner in learners[1:]:
            self.delta.add_(learner.params).sub_(self.pulled)

    def _push(self, flag: float) -> None:
        """Send every server its slice of Δ (or DONE); on UPDATE wait for the replies and adopt w. A lost
        server's shard goes to its backup (:mod:`.server_backup`); without one the job ends (ElasticEnd):
        the model lives there."""
        assert self.comm is not None
        rank = self.comm.rank
        # the first worker first in line
        with server_lost(f"worker rank {rank}", "a parameter server", SERVER_LOST, place=rank - self.servers):
            self._push_to_servers(flag)
        self._resends.clear()

    def _to(self, j: int) -> int:
        """The rank serving shard ``j`` now (its server, or its backup once the server was lost)."""
        return self.routes.now[j] if self.routes is not None else j

    def _push_again(self, j: int) -> Handle | None:
        """Shard j's server was lost mid-exchange: its backup gets the pushes it lacks (the notice says how
        many it counted), each answered, and then this one, whose reply is awaited (a push it already counts
        is answered, not applied again); None: no backup left."""
        assert self.routes is not None
        to = self.routes.lost(j)
        if to is None:
            return None
        self._catch_up(j, to, last=self.requests + 1)
        reply = self.ps.irecv(self.replies[j], to, PULL_TAG)
        self._resends.append(self.ps.isend(self.pushes[j], to, PUSH_TAG))
        return reply

    def _catch_up(self, j: int, to: int, last: int) -> int:
        """Send backup ``to`` this worker's pushes it did not acknowledge before ``last``, oldest first, each
        answered before the next; returns the pushes it had counted (its notice)."""
        assert self.routes is not None
        counted, _ = self.routes.notice(j, self.patience.doubled())
        scratch = torch.empty_like(self.replies[j])
        for number, push in self.unconfirmed[j]:
            if counted < number < last:
                reply = self.ps.irecv(scratch, to, PULL_TAG)
                sent = self.ps.isend(push, to, PUSH_TAG)
                wait_for(
                    {to: reply},
                    self.patience.doubled(),
                    self.routes.worker,
                    f"for the reply to push {number}",
                )
                sent.wait()
        return counted

    def _done_again(self, j: int) -> Handle | None:
        """Shard j's server was lost before acknowledging DONE: its backup gets the pushes it lacks, and the
        DONE unless its notice says it saw it, whose acknowledgement is then awaited; None: no backup left."""
        assert self.routes is not None
        to = self.routes.lost(j)
        if to is None:
            return None
        self._catch_up(j, to, last=self.requests + 1)
        if self.routes.seen_done:
            return DoneHandle()
        ack = self.ps.irecv(self.acks[j], to, DONE_ACK_TAG)
        self._resends.append(self.ps.isend(self.pushes[j], to, PUSH_TAG))
        return ack

    def _sent(self, sends: Mapping[int, Handle]) -> None:
        """Every push's send completed; a send to a server lost since (its shard went to the backup) is
        left, and the sends to the backups are waited for."""
        for j, handle in sends.items():
            with Forgetting(j, None if self._to(j) == j else lambda rank: None):
                handle.wait()
        for handle in self._resends:
            handle.wait()

    def _push_to_servers(self, flag: float) -> None:
        assert self.pool is not None and self.comm is not None
        if flag == UPDATE:
            self._compute_delta()
        for j, (lo, hi) in enumerate(self.bounds):
            n, head = hi - lo, hi - lo + self._stats_size(j)
            if flag == DONE:
                self.pushes[j][:n].zero_()
            else:
                self.pushes[j][:n].copy_(self.delta[lo:hi])
            if head > n:
                self.pushes[j][n:head].copy_(learners_mean_buffers(self.pool))
            number = self.requests + (flag != DONE)  # a DONE: how many pushes were made
            header = [flag, self._progress(), self.seen[j], number]
            self.pushes[j][head:] = torch.tensor(header, dtype=self.w.dtype)
        backed = self.routes is not None
        who = f"worker rank {self.comm.rank}"
        if flag == DONE:
            shards = range(self.shards) if backed else range(0)
            acks = {
                j: Rerouted(
                    self.ps.irecv(self.acks[j], self._to(j), DONE_ACK_TAG), partial(self._done_again, j)
                )
                for j in shards
            }
            sends = {j: self.ps.isend(self.pushes[j], self._to(j), PUSH_TAG) for j in range(self.shards)}
            if acks:  # a backup must know whether this DONE reached the servers
                wait_for(acks, self.patience.doubled(), who, "for its DONE's acknowledgement")
                self.unconfirmed = [[] for _ in self.bounds]  # a DONE is acknowledged once the backup has all
            self._sent(sends)
            return
        if backed:  # kept until the backup acknowledges it: sent again if the server is lost before
            for j in range(self.shards):
                self.unconfirmed[j].append((self.requests + 1, self.pushes[j].clone()))
        with span("push and reply", "message", track="messages", servers=self.shards):
            recvs: dict[int, Handle] = {
                j: self.ps.irecv(self.replies[j], self._to(j), PULL_TAG) for j in range(self.shards)
            }
            if backed:
                recvs = {j: Rerouted(recv, partial(self._push_again, j)) for j, recv in recvs.items()}
            sends = {j: self.ps.isend(self.pushes[j], self._to(j), PUSH_TAG) for j in range(self.shards)}
            # held back by a server while this worker is too far ahead (SSP)
            what = f"for the reply to push {self.requests + 1}"
            alive = self.hosted.check if self.hosted is not None else None
            wait_for(recvs, self.patience.doubled(), who, what, alive)
            self._sent(sends)
        for j, (lo, hi) in enumerate(self.bounds):
            self.w[lo:hi].copy_(self.replies[j][: hi - lo])
            self.seen[j] = int(self.replies[j][hi - lo])
            if backed:
                confirmed = int(self.replies[j][hi - lo + 1])
                self.unconfirmed[j] = [(k, push) for k, push in self.unconfirmed[j] if k > confirmed]
        self._adopt()
        self.requests += 1

    def _adopt(self) -> None:
        """Every learner and x_pulled become w."""
        assert self.pool is not None
        for learner in self.pool.learners:
            learner.params.copy_(self.w)
        self.pulled.copy_(self.w)

    def serve_shard(self) -> None:
        """A colocated rank starts serving its shard at its first exchange, once its own state is restored
        (pushes that arrive before wait in MPI's queue)."""
        if self.hosted is not None:
            self.hosted.start()

    def exchange(self, step: int) -> None:
        """Every τ-th step a worker pushes Δ and adopts the server's w."""
        self.serve_shard()
        self._steps = step + 1
        if self.server is None and self._steps % self.hyper.tau == 0:
            self._push(UPDATE)

    def serve(self, report: Report) -> None:
        """A server rank's loop (the served model is reported once per epoch when one server holds it all)."""
        if self.server is None:
            super().serve(report)
            return
        resume = False
        if self.mirrored is not None and not self.server.took_over:  # a backup: mirror the server until
            self.server.done = set(self.server.lost)  # every worker is done (this round), or its loss
            self.server.patience = self.patience.doubled()
            wire = self.comm.exact  # as the server's mirror sends: uncompressed
            if mirror_until_done(self.server, wire, self.mirrored, self.patience.doubled(), self.tick):
                return
            self.server.take_over(self.mirrored)
            resume = True
        if self.servers > 1:
            log.info("%d servers hold shards of the model: it is validated at the end only", self.servers)
            self.server.serve(None, self.tick, self.patience, resume)
            return
        assert self.pool is not None
        # validate w with the workers' BatchNorm statistics, not the server's initial ones
        self.server.serve(self.server.stats.reporting(self.pool, report), self.tick, self.patience, resume)

    def finish(self) -> None:
        """A worker sends done (a colocated one then serves its shard until every worker has); a server has
        nothing in flight once serve() returned."""
        if self.server is None and self.comm is not None:
            self._push(DONE)
            if self.hosted is not None:
                self.hosted.start()  # a rank that never pushed still serves its shard to the others
                self.hosted.join()
        served = self.hosted_server
        if served is not None and served.in_flight:
            raise RuntimeError(f"parameter server finished with {served.in_flight} message(s) in flight")

    def rearm(self) -> None:
        """After a snapshot: a colocated rank serves its shard again (a server rank serves when called)."""
        if self.hosted is not None:
            self.hosted.start()

    @property
    def in_flight(self) -> int:
        """The server's outstanding requests (a worker waits for each reply at once: 0)."""
        served = self.hosted_server
        return served.in_flight if served is not None else 0

    @property
    def served(self) -> int:
        """Pushes a server rank (placement = rank) received so far, DONE messages not counted; 0 elsewhere
        (a colocated rank trains: its steps are its clock)."""
        return self.server.received if self.server is not None else 0

    def sync_state(self) -> None:
        """After finish: every rank gets the servers' final w, slice j from server j, and the workers' mean
        BatchNorm statistics (a collective; exact, never compressed)."""
        assert self.comm is not None
        if self.server is not None and self.server.took_over:  # the end's line of a backup that served
            # (ranks in the start numbering: the survivors were renumbered at the end)
            log.warning(
                "backup rank %d, serving since parameter server rank %d was lost: %d update(s) from %d "
                "worker(s) in all%s", self.backup_ranks(self.start_size)[self.mirrored or 0], self.mirrored,
                self.server.updates,
                len(self.server.workers), self.server.accounting(),
            )  # fmt: skip
        if self.shard is not None:  # the colocated shard's w is the one to share
            lo, hi = self.bounds[self.comm.rank]
            self.w[lo:hi].copy_(self.shard.w)
        roots = self.roots or list(range(self.shards))
        for j, (lo, hi) in enumerate(self.bounds):
            self.comm.exact.broadcast(self.w[lo:hi], root=roots[j]).wait()
        self.share_trained_buffers(self.server is None)
        self._synced = True

    def eval_params(self) -> torch.Tensor | None:
        """The servers' w (on a single server at any time; elsewhere only after sync_state)."""
        return self.w if (self.server is not None and self.servers == 1) or self._synced else None

    def local_consensus(self) -> torch.Tensor | None:
        """A worker's w as it last pulled it from the servers; a server's as :meth:`eval_params`."""
        return self.w if self.server is None else self.eval_params()

    def state_dict(self) -> dict[str, Any]:
        """w and the counters: a server's per-worker clocks, pulls and staleness counts (taken after
        ``finish``, when no reply is held and nothing is in flight); a worker's seen counts and requests."""
        state = {**super().state_dict(), "w": self.w.clone(), "steps": self._steps}
        server = self.hosted_server
        if server is not None:
            state.update(
                {name: dict(getattr(server, name)) for name in SERVER_COUNTS_PER_WORKER},
                **{name: getattr(server, name) for name in SERVER_COUNTS},
            )
        if self.shard is not None:
            state["shard"] = self.shard.w.clone()
        if self.server is None:
            state.update(adopted=list(self.seen), requests=self.requests)  # the update counts last adopted
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore w and the counters."""
        self.w.copy_(state["w"])
        self._steps = int(state.get("steps", 0))
        server = self.hosted_server
        if server is not None:
            for name in SERVER_COUNTS_PER_WORKER:
                getattr(server, name).update(state.get(name, {}))
            for name in SERVER_COUNTS:
                setattr(server, name, int(state.get(name, 0)))
        if self.shard is not None:
            self.shard.w.copy_(state["shard"])
        if self.server is None:
            self.seen = [int(v) for v in state.get("adopted", self.seen)]
            self.requests = int(state.get("requests", 0))
            self.pulled.copy_(self.w)  # a worker saved after adopting w
