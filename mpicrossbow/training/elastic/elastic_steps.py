"""Elastic steps: a synchronous rule's steps are committed on every survivor or on none, and a lost rank costs
the steps since the last commit, not the job (``[elastic] enabled``).

Steps run in windows of ``[elastic] commit_every`` (a window ends after step s when s + 1 is a multiple of
it, and before every collective between steps: validation, the epoch's statistics, the signal check,
a checkpoint). A window ends as torchft ends a step: a fault-tolerant agreement that every step of it
completed on every rank (:meth:`~mpicrossbow.comm.elastic.ElasticCommunicator.commit`,
``MPI_Comm_agree``). At each commit every rank keeps a copy of what the steps change (its learners'
weights, buffers, optimizer state and the rule's state: ``state_dict``; two copies alternate, each one
copied into the tensors of the one before the last, so no commit allocates: a clone took 68 ms where the
copy takes 9 ms on a 17M-parameter MLP). A rank that meets a lost rank inside a window (an operation
failed: the communicator is revoked, so every other rank's next operation fails too) trains no more in
it: it goes through the window's remaining steps without computing, and at its end the agreement says
the window did not complete. Then every survivor

1. recovers the communicator (revoke, shrink, rebuild: :meth:`ElasticCommunicator.recover`);
2. restores its copy, so no survivor keeps a partial step — a collective that completed on some ranks
   before the death and failed on others is undone everywhere, and the survivors' replicas are bit for bit
   what they were at the last commit; the window's steps are **dropped** (their batches are not trained;
   the step count, the learning-rate schedule and the epoch go on);
3. moves the run's world on (rank, size and communicator in the parts that gather or report), tells the
   rule (``on_rebind``: it rebuilds splits and peers; every mean divides by the new size, read from the
   communicator at each use) and logs one line naming the lost ranks and the step.

So ``commit_every`` trades the agreement and the copy per step (about 9 % of a 3 ms digits step here,
benchmarks/elastic_cost.py) for up to that many steps of the survivors' work lost with a rank.

The lowest survivor is rank 0 afterwards: the run folder, ``metrics.h5`` and validation lines are its. The
collectives between steps (the epoch's statistics, validation) are retried over the survivors until they
commit, so an epoch is reported once. The lost rank's data shard is dropped for the rest of the run: each
survivor keeps reading its own shard, so steps per epoch, the schedule and the epoch count stay as they were
(re-partitioning the data among survivors would change all three mid-run).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ...comm.committed import until_committed
from ...comm.elastic import ElasticCommunicator, MPIGroup
from ...comm.ulfm import ElasticEnd, PeerLost
from ...log import setup_logging
from ..checkpoints.checkpoint_files import Checkpointer
from ..run.parts import RankParts
from . import replacement
from .replacement import Handover, Offer

log = logging.getLogger(__name__)

#: Said once, with a job's first loss: Open MPI's libnbc prints its own lines about the same event just
#: before ours, unconditionally, and they read like a crash.
LIBNBC_NOTE = (
    " (Open MPI's 'NBC_Progress: an error 75 was found during schedule ... aborting the schedule' lines just "
    "before this one are its non-blocking collectives giving up on the lost rank: expected after a loss)"
)

T = TypeVar("T")


def cloned(value: Any, into: Any = None) -> Any:
    """A copy of ``value`` with every tensor copied (dicts, lists and tuples walked; the rest shared): into
    the tensor at the same place of ``into`` — an earlier copy of the same structure — where its shape,
    dtype and device match (no allocation), else into a new clone."""
    if isinstance(value, torch.Tensor):
        same = isinstance(into, torch.Tensor) and (into.shape, into.dtype, into.device) == (
            value.shape,
            value.dtype,
            value.device,
        )
        return into.copy_(value.detach()) if same else value.detach().clone()
    if isinstance(value, dict):
        old = into if isinstance(into, dict) else {}
        return {k: cloned(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        old = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        return type(value)(cloned(v, o) for v, o in zip(value, old, strict=True))
    return value


class ElasticSteps:
    """One rank's part of elastic training: commits its steps, recovers with the other survivors."""

    def __init__(
        self,
        parts: RankParts,
        comm: ElasticCommunicator,
        min_ranks: int,
        every: int = 1,
        replace: bool = False,
    ) -> None:
        if every < 1:
            raise ValueError(f"commit every {every} steps: at least 1")
        self.parts, self.comm, self.min_ranks, self.every = parts, comm, min_ranks, every
        #: ``[elastic] replace``: a lost rank gets a replacement (:meth:`admit`).
        self.replace = replace
        #: The state at the last commit (what a dropped window restores), once taken.
        self.saved: tuple[Any, Any] | None = None
        #: The copy before ``saved``: the next capture is copied into its tensors (two alternate).
        self.spare: tuple[Any, Any] | None = None
        #: The ranks (numbered as before it) the last recovery lost.
        self.lost: tuple[int, ...] = ()
        #: Called after every recovery, before the rule's ``on_rebind`` (parts with work in flight on the
        #: lost world's communicator drop it here).
        self.after_recovery: list[Callable[[], None]] = []
        #: Seconds from meeting a loss to training again, one entry per recovery (the benchmark's figure).
        self.recoveries: list[float] = []
        #: Steps done (committed or dropped) before the step running now, or all of them between steps.
        self.steps_done = int(parts.checkpoints.position.get("step", 0))
        #: ``steps_done`` at the last commit: what the survivors' state holds after a recovery.
        self.committed = self.steps_done
        #: Steps run since the last commit (the open window).
        self.pending = 0
        #: Where and when this rank met a lost rank in the open window, else None.
        self.met: tuple[str, float] | None = None
        #: ``[elastic] replace``: the start ranks lost and not yet replaced (:meth:`admit` at the next step).
        self.vacancies: tuple[int, ...] = ()
        #: When the latest recovery's loss was met (``time.perf_counter``): what a replacement is timed from.
        self.lost_at = 0.0
        #: Start rank -> host, as the membership knew them before a loss: where a replacement starts.
        self.hosts: dict[int, str] = {}

    def step(self, run: Callable[[], float], step: int) -> float:
        """Run ``run`` (one train_step; returns its exchange seconds) inside the open window, and commit
        the window after it when it ends here; 0.0 when this rank met a lost rank in the window (it then
        skips ``run`` to the window's end) or the commit dropped the window.

        The copy to restore is taken at each commit (before the first step, at start): taking it completes
        what the step left in flight (SMA's allreduce of its corrections), so the agreement that follows
        covers the whole exchange — at the price of SMA's overlap of that allreduce with the next step's
        backward, once a window."""
        self.steps_done = step
        if self.saved is None:
            self.saved = self.capture()
        seconds = 0.0
        if self.met is None:
            try:
                seconds = run()
            except PeerLost:
                self.met = (f"step {step}", time.perf_counter())
        self.pending += 1
        self.steps_done = step + 1
        if (step + 1) % self.every:
            return seconds  # the window goes on (on a rank that met a loss: without training)
        return seconds if self.flush(f"step {step}") else 0.0

    def flush(self, where: str) -> bool:
        """End the open window (if a step ran since the last commit): agree that every rank completed it,
        and keep a copy of the state; or, when some rank did not, recover, restore the last commit's copy
        on every survivor (the window's steps are dropped) and return False. ``where`` names the point in
        the log when this rank met no loss itself."""
        if not self.pending:
            return True
        self.pending, ok, after = 0, self.met is None, None
        if ok:
            try:
                after = self.capture(self.spare)
            except PeerLost:
                ok, self.met = False, (where, time.perf_counter())
        if self.comm.commit(ok):
            self.spare, self.saved, self.committed = self.saved, after, self.steps_done
            return True
        met, started = self.met or (where, time.perf_counter())
        self.met = None
        first, last = self.committed, self.steps_done - 1
        dropped = f"step {first}" if last == first else f"steps {first}-{last}"
        self.recover(met if met == dropped else f"{met}, {dropped} dropped", started)
        self.parts.rule.on_rebind(self.lost)  # first: a rule drops what it had in flight on the lost world
        pool_state, rule_state = self.saved  # type: ignore[misc]
        self.parts.pool.load_state_dict(pool_state)
        self.parts.rule.load_state_dict(rule_state)
        # torch's Optimizer.load_state_dict keeps the given tensors as its state (no copy when dtype and
        # device match): the copies are live state now, so the next step takes fresh ones.
        self.saved = self.spare = None
        self.committed = self.steps_done  # the step count goes on from the restored state
        return False

    def capture(self, into: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
        """A copy of everything a step changes: the learners' state and the rule's (what a dropped step
        restores; benchmarks/elastic_cost.py times it), copied into ``into``'s tensors (an earlier capture
        no longer needed) where they fit."""
        return cloned((self.parts.pool.state_dict(), self.parts.rule.state_dict()), into)

    def collective(self, fn: Callable[..., T], what: str) -> Callable[..., T]:
        """``fn`` as a committed collective: the open window committed first, then ``fn`` retried over the
        survivors until every one completed it."""

        def recovered(started: float) -> None:
            self.recover(what, started)
            self.parts.rule.on_rebind(self.lost)

        def run(*args: Any) -> T:
            self.flush(what)
            return until_committed(
                lambda _redo: fn(*args), self.comm.commit, recovered, clock=time.perf_counter
            )

        return run

    def settle(self, where: str) -> None:
        """Asynchronous rules: their ranks meet only after ``finish`` (a server forgot a lost worker as it
        met it, :meth:`~mpicrossbow.rules.parameter_server.ParameterServer.forget`). Agree whether every
        rank is still there; if not, shrink to the survivors, move the world on and rebind the rule, so
        the run's last collectives (statistics, the final model, metrics.h5) span the survivors."""
        started = time.perf_counter()
        if not self.comm.commit(True):
            self.recover(where, started)
            self.parts.rule.on_rebind(self.lost)

    def recover(self, where: str, started: float) -> None:
        """Shrink to the survivors and move the run's world on; ElasticEnd below ``min_ranks``."""
        before = self.comm.membership
        after = self.comm.recover()
        self.lost = after.lost_since(before)
        names = ", ".join(str(before.ranks[r]) for r in self.lost)
        if after.size < self.min_ranks:
            raise ElasticEnd(
                f"lost rank(s) {names} at {where}: {after.size} rank(s) left, fewer than "
                f"[elastic] min_ranks = {self.min_ranks}",
                place=after.rank,
            )
        if self.replace:
            self.vacancies += tuple(before.ranks[r] for r in self.lost)
            self.hosts.update(zip(before.ranks, before.hosts, strict=False))
            self.lost_at = started
        self._move_world(after.rank, after.size)
        for hook in self.after_recovery:
            hook()
        if after.rank == 0 and before.rank != 0:
            self._take_over(names)
        seconds = time.perf_counter() - started
        self.recoveries.append(seconds)
        if after.rank == 0:
            log.warning(
                "elastic: lost rank(s) %s (start numbering) at %s; %d rank(s) go on (%s); "
                "recovered in %.3fs%s",
                names,
                where,
                after.size,
                after,
                seconds,
                LIBNBC_NOTE if len(self.recoveries) == 1 else "",
            )

    def admit(self, position: dict[str, Any]) -> None:
        """``[elastic] replace``, at the start of the first step after a recovery (every survivor holds the
        committed state, no window is open): spawn a replacement for every vacancy and go on with them from
        ``position`` (the protocol: :mod:`.replacement`). Collective over the survivors, then the grown
        world."""
        assert not self.pending, "replacements join at a window's start"
        parts, comm = self.parts, self.comm
        vacancies, self.vacancies = self.vacancies, ()
        started = time.perf_counter()
        parts.rule.sync_state()
        held = parts.rule.eval_params()
        consensus = (held if held is not None else parts.pool.learners[0].params).clone()
        mine = self.capture()  # the binding below overwrites the learners: put back after it
        before = comm.membership
        lost_hosts = tuple(self.hosts.get(r, "") for r in vacancies)
        merged = replacement.spawn_replacements(
            comm.group.native, vacancies, lost_hosts if all(lost_hosts) else ()
        )
        if merged is None:
            if before.rank == 0:
                log.warning("elastic: training goes on with %d rank(s), without replacements", before.size)
            return
        spawned = time.perf_counter()
        hosts = before.hosts + tuple(replacement.connect(merged, before.size))
        ranks = before.ranks + vacancies
        offer = Offer(
            ranks, before.version + 1, str(parts.reporter.run_dir), position, torch.get_num_threads(), hosts
        )
        merged.bcast(offer if before.rank == 0 else None, root=0)
        group = comm.group
        assert isinstance(group, MPIGroup), "replacements are spawned over MPI"
        after = comm.grow(group.merged(merged), ranks, hosts)
        self._move_world(after.rank, after.size)
        parts.rule.bind(comm, parts.pool)
        if after.rank == 0:
            handover = Handover(mine[0], mine[1], consensus)
            replacement.send_handover(merged, range(before.size, after.size), handover)
        parts.pool.load_state_dict(mine[0])
        parts.rule.load_state_dict(mine[1])
        self.saved = self.spare = None  # the loaded copies are live state now (as after a restore)
        if after.rank == 0:
            now = time.perf_counter()
            log.warning(
                "elastic: start rank(s) %s replaced at step %d; %d rank(s) again (%s); %.2fs after the "
                "loss was met (spawn %.2fs, the replacements' set-up and handover %.2fs)",
                ", ".join(map(str, vacancies)),
                position["step"],
                after.size,
                after,
                now - self.lost_at,
                spawned - started,
                now - spawned,
            )

    def _take_over(self, lost: str) -> None:
        """This rank is rank 0 now, the lowest survivor of a lost rank 0: its duties pass here — metrics.h5
        (every epoch once), TensorBoard, the checkpoint folder's lock; the run folder is the one every rank
        was given at start."""
        parts = self.parts
        rows = parts.reporter.take_over(self.committed)
        locked = parts.checkpoints.take_over()
        log.warning(
            "elastic: rank 0 (start rank %s) was lost; start rank %d takes over its duties: metrics.h5 "
            "(%d epoch row(s) kept)%s, run folder %s",
            lost,
            self.comm.membership.original_rank,
            rows,
            ", the checkpoint lock" if locked else "",
            parts.reporter.run_dir,
        )

    def _move_world(self, rank: int, size: int) -> None:
        """Put the new world where the run's parts read it (reporting, evaluation, checkpoints) and in the
        log lines' ``[rank r/size]``."""
        parts, mpi = self.parts, self.comm.group.native
        local_rank, local_size = rank, size  # the in-process fault double: one node, no MPI
        if mpi is not None:
            from mpi4py import MPI

            local = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            local_rank, local_size = local.rank, local.size
            local.Free()
        world = dataclasses.replace(
            parts.world, rank=rank, size=size, local_rank=local_rank, local_size=local_size, mpi=mpi
        )
        parts.world = parts.reporter.world = parts.evaluator.world = parts.checkpoints.world = world
        level = logging.INFO if rank == 0 else logging.WARNING
        if mpi is not None:  # a process per rank (not the in-process fault double)
            setup_logging(rank, size, level)
        saver = parts.checkpoints.saver
        if saver is not None:
            parts.checkpoints.saver = Checkpointer(saver.directory, rank, size, saver.keep, mpi)
