"""Replacements (``[elastic] replace``): after elastic training lost ranks, the survivors start one new
process for each, hand it the consensus state from a live peer (no disk), and the world grows back.

Who sends what to whom, in order (S: every survivor, J: every replacement, M: the merged communicator):

1. **Spawn.** At the first step after a recovery that every survivor trains, S call ``MPI_Comm_spawn`` over a
   duplicate of their communicator, **on a thread of their own** (:class:`BackgroundSpawn`; MPI runs with
   ``MPI_THREAD_MULTIPLE`` when ``[elastic] replace`` is on): one process per lost rank, the job's own command
   line (``sys.orig_argv``), with :data:`REPLACES` in its environment naming the start rank it stands for. J
   starts as any rank does (Python, ``import torch``: about 2 s here; its optimizer will not import the
   compiler, which S would wait 1-1.7 s for after step 2: :mod:`mpicrossbow.dynamo_on_demand`), finds
   :data:`REPLACES` and merges; S's thread merges too, first, so every survivor keeps its rank and rank 0 its
   duties, and greets each replacement (:func:`connect`). Meanwhile S **train on**: at the start of every step
   they agree (one allreduce of a flag) whether every survivor's thread is done, and go on to step 2 at the
   first step where it is — a commit window's start, every survivor holding the committed state. Only when
   every member (lost ones included) is on one host: across hosts, Open MPI 5.0's ``MPI_Comm_spawn`` on a
   thread stalls the survivors' own collectives over TCP and itself, for a minute to several (2 namespace
   nodes: spawns of 3.8, 30, 62 and 201 s and one past 280 s in five runs, against 2.6 s in each of four when
   the survivors wait), so there S wait for the spawn (:func:`spawn_threaded`).
2. **Offer.** Rank 0 broadcasts an :class:`Offer` over M: the start ranks every member stands for, the
   run folder, the loop position and the thread count. J prepares locally as the lost start rank would
   have: its device, its data shard, its seed (S wait meanwhile, in the next collective).
3. **Communicator and binding.** Everyone builds the run's communicator over M (the factory of the start),
   then binds the rule over it, collectively, as at start. The binding's broadcast overwrites the
   survivors' learners with rank 0's learner 0: each survivor puts back the state it held before.
4. **Handover.** Rank 0 sends each replacement a :class:`Handover`: its learners' state, the rule's and
   the consensus weights (the rule's :meth:`~mpicrossbow.rules.base.Rule.eval_params` after ``sync_state``;
   learner 0's for BSP). The replacement loads them and sets every learner's weights to the consensus, so its
   replicas equal the survivors' consensus at its first step. Its optimizer state (momentum) is rank 0's:
   a warm start, where zeros would take a few steps to build up again.
5. Every member goes on at the same step, ``[elastic] commit_every`` windows and all.

The lost rank's data shard is read by its replacement from the position the survivors are at (the batches
the lost rank trained since the last commit are dropped with the window, as without replacements).
Replacements cover synchronous rules: an asynchronous rule's server or gossip peers would have to admit a
worker mid-protocol (:func:`replace_obstacle` refuses them in one line).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...comm.base import ReduceOp
from ...comm.elastic import MPIGroup
from ...comm.membership import Membership
from ...config import Config
from ...errors import ConfigError
from ...launch.world import OVERSUBSCRIBED_SETTINGS
from ...pool.replica_view import ReplicaView
from ...rules.base import Rule
from .fault_tolerance import FaultTolerance, Stateful

log = logging.getLogger(__name__)

#: Set in a replacement's environment by the survivors that spawn it: the start rank it stands for.
REPLACES = "CROSSBOW_REPLACES"

#: The tag of the handover (rank 0 to each replacement, over the merged communicator).
HANDOVER_TAG = 7405

#: The tag of :func:`connect`'s messages.
HELLO_TAG = 7406


def replaced_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """The start rank this process replaces (survivors spawned it), or None for a rank of the start world."""
    value = (os.environ if environ is None else environ).get(REPLACES, "")
    return int(value) if value.isdigit() else None


def replace_obstacle(config: Config, rule: Rule, elastic: bool) -> str | None:
    """Why ``[elastic] replace = true`` cannot be honoured for this run (one line), or None."""
    if not config.elastic.replace:
        return None
    if not elastic:
        return (
            "[elastic] replace = true needs elastic training ([elastic] enabled = true, or auto where it can)"
        )
    if not rule.synchronous:
        return (
            f"[elastic] replace = true covers the synchronous rules; RULE={config.rule} is asynchronous (its "
            "servers or gossip peers would admit a worker mid-protocol): set elastic.replace=false"
        )
    if config.pool.learners == "auto":
        return "[elastic] replace = true needs a fixed learner count: set [pool] learners to a number"
    return None


def check_replace(config: Config, rule: Rule, elastic: bool) -> None:
    """ConfigError (exit 2 on every rank before training) when ``replace`` cannot be honoured."""
    obstacle = replace_obstacle(config, rule, elastic)
    if obstacle is not None:
        raise ConfigError(obstacle)


@dataclass(frozen=True)
class Offer:
    """What rank 0 tells every member first, over the merged communicator (step 2 above)."""

    #: The start rank each member stands for, in rank order (survivors first, then the replacements).
    ranks: tuple[int, ...]
    #: The membership's version once the replacements are in.
    version: int
    #: The run folder every rank writes into.
    run_dir: str
    #: The loop's position at the step every member goes on from (what a checkpoint records).
    position: dict[str, Any]
    #: Torch threads per rank (the survivors' rank 0's).
    threads: int
    #: Each member's host, in rank order (the membership's).
    hosts: tuple[str, ...] = ()


@dataclass
class Handover:
    """What rank 0 sends each replacement (step 4): the state of every part its fault tolerance restores
    (:meth:`~.fault_tolerance.FaultTolerance.capture`, in its order: the pool or the user's model, the rule,
    what ``xb.keep`` was given) and the consensus weights."""

    states: tuple[Any, ...]
    consensus: torch.Tensor

    def install(self, parts: Sequence[Stateful], learners: Sequence[Any]) -> tuple[Any, ...]:
        """Load the survivor's state into ``parts`` (the first of :attr:`states`, in order), then set every
        one of ``learners``' weights to the consensus; the states left over (the embedded API's
        ``xb.keep`` objects, made after this)."""
        for part, state in zip(parts, self.states, strict=False):
            part.load_state_dict(state)
        for learner in learners:
            learner.params.copy_(self.consensus)
        return self.states[len(parts) :]


def spawn_replacements(native: Any, start_ranks: tuple[int, ...], hosts: tuple[str, ...] = ()) -> Any:
    """Collective over the survivors' mpi4py communicator ``native``: start one process per entry of
    ``start_ranks`` (the job's command line, :data:`REPLACES` set to that entry) on the host of the same
    entry of ``hosts`` where given — the lost rank's, whose slot its death freed; Open MPI's runtime still
    counts that slot as taken, so the spawn asks for ``slot:OVERSUBSCRIBE`` — or, when that fails (a lost
    node), wherever the runtime maps it; then merge with them. The merged communicator (survivors first),
    its errors returned as exceptions; None when no process could be started (every survivor alike: the
    spawn is collective)."""
    from mpi4py import MPI

    for where in (hosts, ()) if hosts else ((),):
        try:
            inter = _spawn(native, start_ranks, where)
        except MPI.Exception as exc:
            if native.Get_rank() == 0:
                log.warning(
                    "elastic: could not start replacement(s)%s: %s", f" on {list(where)}" * bool(where), exc
                )
            continue
        merged = inter.Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        return merged
    return None


def _spawn(native: Any, start_ranks: tuple[int, ...], hosts: tuple[str, ...]) -> Any:
    """``MPI_Comm_spawn_multiple`` of the replacements (on ``hosts`` where given); the intercommunicator.
    ``map_by`` is a directive of the whole spawn, given once: Open MPI 5 refuses it repeated on each process
    ("Conflicting directives slot slot:OVERSUBSCRIBE"), and two ranks lost together got no replacement."""
    from mpi4py import MPI

    passed = {key: os.environ[key] for key in OVERSUBSCRIBED_SETTINGS if key in os.environ}
    infos = []
    for i, rank in enumerate(start_ranks):
        info = MPI.Info.Create()
        info.Set("PMIX_ENVAR", "\n".join(f"{k}={v}" for k, v in {REPLACES: str(rank), **passed}.items()))
        if i == 0:
            info.Set("map_by", "slot:OVERSUBSCRIBE")
        if hosts:
            info.Set("host", hosts[i])
        infos.append(info)
    n = len(start_ranks)
    try:
        return native.Spawn_multiple(
            [sys.executable] * n, [list(sys.orig_argv[1:])] * n, [1] * n, infos, root=0
        )
    finally:
        for info in infos:
            info.Free()


def spawn_threaded(mpi_threads: bool, hosts: Mapping[int, str]) -> bool:
    """Whether the survivors train on while the replacements start: MPI runs with ``MPI_THREAD_MULTIPLE`` and
    every member before the loss (``hosts``: start rank -> host; empty when unknown) ran on one host. Across
    hosts the threaded spawn stalled the survivors' collectives for minutes (the module doc)."""
    return mpi_threads and len(set(hosts.values())) <= 1


class BackgroundSpawn:
    """:func:`spawn_replacements` and :func:`connect` on a thread of their own, over a duplicate of the
    survivors' communicator (collective: every survivor builds one at the same step), so the survivors train
    on while the new processes start. Without ``MPI_THREAD_MULTIPLE`` (``threaded`` False) it runs at once,
    and the survivors wait for it as they did before."""

    def __init__(
        self, native: Any, start_ranks: tuple[int, ...], hosts: tuple[str, ...], threaded: bool = True
    ) -> None:
        self.comm = native.Dup()
        self.start_ranks = start_ranks
        #: The merged communicator (survivors first) and the replacements' hosts, once done (None: no
        #: process could be started).
        self.merged: Any = None
        self.hosts: list[str] = []
        #: Seconds the spawn, merge and greeting took.
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(hosts,), name="crossbow-spawn", daemon=True)
        #: Whether the survivors trained on meanwhile (else it ran at once, here).
        self.threaded = threaded
        if threaded:
            self.thread.start()
        else:
            self._run(hosts)

    def _run(self, hosts: tuple[str, ...]) -> None:
        started = time.perf_counter()
        try:
            self.merged = spawn_replacements(self.comm, self.start_ranks, hosts)
            if self.merged is not None:
                self.hosts = connect(self.merged, self.comm.Get_size())
        except BaseException as exc:  # handed to the main thread by result()
            self.error = exc
        self.seconds = time.perf_counter() - started

    @property
    def done(self) -> bool:
        """Whether this survivor's part is over (local)."""
        return not self.thread.is_alive()

    def result(self) -> tuple[Any, list[str]]:
        """(the merged communicator or None, the replacements' hosts), once done; the thread's error raised
        here."""
        if self.thread.ident is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.merged, self.hosts


def connect(merged: Any, first_joiner: int) -> list[str]:
    """Right after the merge, on every member: one message each way between every survivor and every
    replacement (merged ranks from ``first_joiner`` on) — each replacement's host to the survivors, theirs
    back. Open MPI 5.0.11's MPI_Finalize disconnects every pair of processes of two connected jobs and
    segfaults, then hangs, on a pair that never exchanged a message (measured: a replacement that met one
    survivor only in a barrier; every job passed once each pair had exchanged one). Returns the hosts of the
    replacements on a survivor, of the survivors on a replacement, in rank order."""
    mine, me = socket.gethostname(), merged.Get_rank()
    joining = me >= first_joiner
    peers = range(first_joiner) if joining else range(first_joiner, merged.Get_size())
    sends = [merged.isend(mine, dest=p, tag=HELLO_TAG) for p in peers]
    hosts = [merged.recv(source=p, tag=HELLO_TAG) for p in peers]
    for request in sends:
        request.wait()
    return hosts


def merge_with_survivors() -> Any:
    """In a replacement, after MPI started: the communicator merged with the survivors that spawned it (they
    come first), its errors returned as exceptions (then :func:`connect`)."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise RuntimeError(f"{REPLACES} is set but no survivors spawned this process")
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def send_handover(merged: Any, joiners: range, handover: Handover) -> None:
    """Rank 0: the handover to every replacement (merged ranks ``joiners``)."""
    for rank in joiners:
        merged.send(handover, dest=rank, tag=HANDOVER_TAG)


def receive_handover(merged: Any) -> Handover:
    """A replacement: rank 0's handover."""
    handover = merged.recv(source=0, tag=HANDOVER_TAG)
    assert isinstance(handover, Handover)
    return handover


class Replacements:
    """A survivor's side of ``[elastic] replace`` (the protocol: the module doc), for whichever loop the owner
    ``tolerance`` runs (crossbow-launch's, or the user's own through the embedded API): the start ranks lost
    and not replaced yet and where they ran, the replacements starting on a thread while the survivors train
    (``threaded``: MPI runs with ``MPI_THREAD_MULTIPLE``; else the spawn blocks), and the world's growth."""

    def __init__(self, tolerance: FaultTolerance, threaded: bool, limit: int = 3) -> None:
        self.tolerance, self.threaded = tolerance, threaded
        #: ``[elastic] max_replacements``: replacements started in all, at most.
        self.limit = limit
        #: Replacements started so far (this rank's count: agreed with the others at each spawn, since a
        #: replacement, a member now, started counting at 0).
        self.started = 0
        #: The start ranks lost and not yet replaced (a spawn starts at the next step).
        self.vacancies: tuple[int, ...] = ()
        #: Start rank -> host, as the membership knew them before a loss: where a replacement starts.
        self.hosts: dict[int, str] = {}
        #: The replacements starting while the survivors train, and the step and time they were asked for
        #: at; None when none is starting.
        self.spawning: BackgroundSpawn | None = None
        self.spawned_at = (0, 0.0)
        tolerance.followers.append(self._vacate)

    def _vacate(self, before: Membership, after: Membership) -> None:
        """A loss: the lost start ranks become vacancies, filled at the next step."""
        if after.size < before.size:
            self.vacancies += tuple(before.ranks[r] for r in after.lost_since(before))
            self.hosts.update(zip(before.ranks, before.hosts, strict=False))

    def due(self, step: int) -> BackgroundSpawn | None:
        """At the start of step ``step`` (collective over the survivors): at the first step after a
        recovery that every survivor trains (after healing, a rank whose loop was behind skips steps first)
        the replacements start on a thread of each survivor's (at once, across hosts: :func:`spawn_threaded`).
        Then, at the first step starting a commit
        window (every step, healing) where every survivor's thread is done — one allreduce of a flag each
        such step meanwhile, the survivors training until then — the finished spawn: admit it now
        (:meth:`admit`). None otherwise."""
        tolerance = self.tolerance
        if self.spawning is not None:
            if tolerance.pending:  # inside a commit window: they join at a window's start
                return None
            flag = [float(self.spawning.done)]
            if not tolerance.comm.exact.allreduce_scalars(flag, op=ReduceOp.MIN)[0]:
                return None
            spawning, self.spawning = self.spawning, None
            self.vacancies = tuple(r for r in self.vacancies if r not in spawning.start_ranks)
            return spawning
        if self.vacancies and step >= tolerance.skip_until:
            if not self._within_limit():
                return None
            lost_hosts = tuple(self.hosts.get(r, "") for r in self.vacancies)
            self.spawned_at = (step, time.perf_counter())
            native = tolerance.comm.group.native
            self.spawning = BackgroundSpawn(
                native,
                self.vacancies,
                lost_hosts if all(lost_hosts) else (),
                spawn_threaded(self.threaded, self.hosts),
            )
        return None

    def _within_limit(self) -> bool:
        """Keep the vacancies the limit still allows (the first ones), counting them as started; say once
        which are not filled. Whether any is left to fill. Collective over the survivors (one allreduce: the
        highest count any of them holds)."""
        tolerance = self.tolerance
        counts = tolerance.comm.exact.allreduce_scalars([float(self.started)], op=ReduceOp.MAX)
        self.started = int(counts[0])
        left = max(self.limit - self.started, 0)
        refused, self.vacancies = self.vacancies[left:], self.vacancies[:left]
        self.started += len(self.vacancies)
        if refused and tolerance.comm.membership.rank == 0:
            log.warning(
                "elastic: start rank(s) %s not replaced: the job started its %d replacement(s) "
                "([elastic] max_replacements = %d); training goes on with %d rank(s)",
                ", ".join(map(str, refused)),
                self.limit,
                self.limit,
                tolerance.comm.membership.size,
            )
        return bool(self.vacancies)

    def cancel(self) -> None:
        """Training ended with replacements still starting: they are told so and leave (they would join a
        run that is over). Collective over the survivors."""
        if self.spawning is None:
            return
        merged, _ = self.spawning.result()
        self.spawning, self.vacancies = None, ()
        if merged is not None:
            merged.bcast(None, root=0)  # no offer: each replacement ends at once

    def admit(
        self,
        spawning: BackgroundSpawn,
        run_dir: str,
        position: dict[str, Any],
        bind: Callable[[], None],
        pool: ReplicaView,
    ) -> Membership | None:
        """Grow the world with the replacements ``spawning`` started, every survivor holding the committed
        state (no window open): the consensus and every part's state taken, the :class:`Offer` (``run_dir``,
        the loop's ``position``) broadcast to every member, the communicator grown (the same membership
        change as a loss's), the rule bound again (``bind``: collective with the replacements, whose
        binding's broadcast overwrites the learners of ``pool``: each survivor puts its own state back after
        it), rank 0's handover sent, and one line said. The grown membership; None when no process could be
        started. Collective over the survivors, then the grown world."""
        tolerance, started = self.tolerance, time.perf_counter()
        merged, joined_hosts = spawning.result()
        before = tolerance.comm.membership
        if merged is None:
            if before.rank == 0:
                log.warning("elastic: training goes on with %d rank(s), without replacements", before.size)
            return None
        tolerance.rule.sync_state()
        held = tolerance.rule.eval_params()
        consensus = (held if held is not None else pool.learners[0].params).clone()
        mine = tolerance.capture()
        hosts = before.hosts + tuple(joined_hosts)
        ranks = before.ranks + spawning.start_ranks
        offer = Offer(ranks, before.version + 1, run_dir, position, torch.get_num_threads(), hosts)
        merged.bcast(offer if before.rank == 0 else None, root=0)
        group = tolerance.comm.group
        assert isinstance(group, MPIGroup), "replacements are spawned over MPI"
        after = tolerance.comm.grow(group.merged(merged), ranks, hosts)
        tolerance.moved(before, after)  # the same path as a loss's
        bind()
        if after.rank == 0:
            send_handover(merged, range(before.size, after.size), Handover(mine, consensus))
        tolerance.restore(mine)
        tolerance.saved = tolerance.spare = None  # the loaded copies are live state now (as after a restore)
        if after.rank == 0:
            step, now = int(position["step"]), time.perf_counter()
            log.warning(
                "elastic: start rank(s) %s replaced at step %d; %d rank(s) again (%s); %.2fs after the "
                "loss was met (spawn %.2fs, %s; the replacements' set-up and handover %.2fs)",
                ", ".join(map(str, spawning.start_ranks)),
                step,
                after.size,
                after,
                now - tolerance.lost_at,
                spawning.seconds,
                f"the survivors training {step - self.spawned_at[0]} step(s) meanwhile"
                if spawning.threaded
                else "the survivors waiting: it ran across hosts",
                now - started,
            )
        return after
