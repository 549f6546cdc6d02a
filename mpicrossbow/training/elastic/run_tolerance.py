"""RunTolerance: a crossbow-launch run's fault tolerance — the one owner
(:class:`~.fault_tolerance.FaultTolerance`) over the run's pool and rule, plus what such a run moves when its
world changes: the parts that report, evaluate and checkpoint follow the new world, the lowest survivor of a
lost rank 0 takes over its duties (metrics.h5, the checkpoint lock), ``[elastic] replace`` spawns
replacements at the next step (the protocol: :mod:`.replacement`), and an asynchronous run's coordinated
snapshots meet over the survivors (:mod:`.elastic_pause`). The session builds it once, when the run is
elastic.

Whether it is — ``[elastic] enabled`` — is decided here too, once per rank before training
(:func:`resolve_elastic`, nothing sent to another rank). ``false`` (the default): a lost rank ends the job,
which resumes from its checkpoints, bit for bit as without elastic training and at no per-step cost.
``true``: elastic or nothing — anything that rules it out (an MPI without ULFM, a job started without
``--with-ft ulfm``, a communicator or rule that cannot follow a shrinking world) is one line and exit status
2 on every rank before training. ``auto``: elastic where all of that holds, else ``false``'s behaviour, said
in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ...comm.base import ReduceOp
from ...comm.elastic import ElasticCommunicator, MPIGroup
from ...comm.membership import Membership
from ...comm.ulfm import ulfm_missing
from ...config import Config, ElasticSection
from ...errors import ConfigError
from ...launch.world import World, mpi_threads_ok
from ...log import setup_logging
from ...rules.base import Rule
from ..checkpoints.checkpoint_files import Checkpointer
from ..checkpoints.pause_orders import PauseOrders
from ..run.parts import RankParts
from . import replacement
from .elastic_pause import ElasticPauseOrders
from .fault_tolerance import FaultTolerance
from .replacement import Handover, Offer, check_replace

log = logging.getLogger(__name__)


class RunTolerance(FaultTolerance):
    """A crossbow-launch run's fault tolerance over ``parts`` (see the module doc)."""

    def __init__(
        self,
        parts: RankParts,
        comm: ElasticCommunicator,
        min_ranks: int,
        every: int = 1,
        replace: bool = False,
        heals: bool | None = None,
    ) -> None:
        steps_done = int(parts.checkpoints.position.get("step", 0))
        state = [parts.pool, parts.rule]
        super().__init__(comm, parts.rule, state, min_ranks, every, steps_done, heals=heals)
        self.parts = parts
        #: ``[elastic] replace``: a lost rank gets a replacement (:meth:`admit`).
        self.replace = replace
        #: ``[elastic] replace``: the start ranks lost and not yet replaced (:meth:`admit` at the next step).
        self.vacancies: tuple[int, ...] = ()
        #: Start rank -> host, as the membership knew them before a loss: where a replacement starts.
        self.hosts: dict[int, str] = {}
        #: The replacements starting while the survivors train (:meth:`before_step`), and the step and time
        #: they were asked for at; None when none is starting.
        self.spawning: replacement.BackgroundSpawn | None = None
        self.spawned_at = (0, 0.0)
        self.followers += [self._vacate, self._move_world, self._take_over]

    @classmethod
    def configured(cls, parts: RankParts, comm: ElasticCommunicator, section: ElasticSection) -> RunTolerance:
        """The run's fault tolerance as ``[elastic]`` (``section``) sets it."""
        return cls(parts, comm, section.min_ranks, section.commit_every, section.replace)

    def before_step(self, position: Callable[[], dict[str, Any]]) -> None:
        """``[elastic] replace``: at the first step after a recovery that every survivor trains (after
        healing, a rank whose loop was behind skips steps first) the replacements start on a thread of each
        survivor's; the world grows back (:meth:`admit`) at the first step starting a commit window (every
        step, healing) where every survivor's thread is done (one allreduce of a flag each such step
        meanwhile), the survivors training until then."""
        if self.spawning is not None:
            if self.pending:  # inside a commit window: they join at a window's start
                return
            done = self.comm.exact.allreduce_scalars([float(self.spawning.done)], op=ReduceOp.MIN)[0]
            if done:
                self.admit(position())
            return
        if not self.vacancies:
            return
        step = int(position()["step"])
        if step >= self.skip_until:
            lost_hosts = tuple(self.hosts.get(r, "") for r in self.vacancies)
            self.spawned_at = (step, time.perf_counter())
            self.spawning = replacement.BackgroundSpawn(
                self.comm.group.native,
                self.vacancies,
                lost_hosts if all(lost_hosts) else (),
                threaded=mpi_threads_ok(self.parts.world),
            )

    def settle(self, where: str) -> None:
        """Replacements still starting when training ends are told so and leave (they would join a run that
        is over), then the owner's settle."""
        if self.spawning is not None:
            merged, _ = self.spawning.result()
            self.spawning, self.vacancies = None, ()
            if merged is not None:
                merged.bcast(None, root=0)  # no offer: each replacement ends at once
        super().settle(where)

    def pause_orders(self, world: World) -> PauseOrders:
        """Snapshots that go on after a loss: the control plane over a fault-tolerant group of its own."""
        return ElasticPauseOrders(self.parts, self.comm)

    def _vacate(self, before: Membership, after: Membership) -> None:
        """``[elastic] replace``: the lost start ranks become vacancies, filled at the next step."""
        if self.replace and after.size < before.size:
            lost = after.lost_since(before)
            self.vacancies += tuple(before.ranks[r] for r in lost)
            self.hosts.update(zip(before.ranks, before.hosts, strict=False))

    def admit(self, position: dict[str, Any]) -> None:
        """``[elastic] replace``, at the start of a step once every survivor's :attr:`spawning` is done (every
        survivor holds the committed state, no window is open): go on with the replacements from
        ``position`` (the protocol: :mod:`.replacement`). Collective over the survivors, then the grown
        world."""
        assert not self.pending and self.spawning is not None, "replacements join at a window's start"
        parts, comm, spawning = self.parts, self.comm, self.spawning
        vacancies, self.spawning = spawning.start_ranks, None
        self.vacancies = tuple(r for r in self.vacancies if r not in vacancies)  # lost while it started
        merged, joined_hosts = spawning.result()
        before = comm.membership
        if merged is None:
            if before.rank == 0:
                log.warning("elastic: training goes on with %d rank(s), without replacements", before.size)
            return
        spawned = time.perf_counter()
        parts.rule.sync_state()
        held = parts.rule.eval_params()
        consensus = (held if held is not None else parts.pool.learners[0].params).clone()
        mine = self.capture()  # the binding below overwrites the learners: put back after it (pool, rule)
        hosts = before.hosts + tuple(joined_hosts)
        ranks = before.ranks + vacancies
        offer = Offer(
            ranks, before.version + 1, str(parts.reporter.run_dir), position, torch.get_num_threads(), hosts
        )
        merged.bcast(offer if before.rank == 0 else None, root=0)
        group = comm.group
        assert isinstance(group, MPIGroup), "replacements are spawned over MPI"
        after = comm.grow(group.merged(merged), ranks, hosts)
        self.moved(before, after)  # the same path as a loss's
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
                "loss was met (spawn %.2fs, the survivors training %d step(s) meanwhile; the replacements' "
                "set-up and handover %.2fs)",
                ", ".join(map(str, vacancies)),
                position["step"],
                after.size,
                after,
                now - self.lost_at,
                spawning.seconds,
                int(position["step"]) - self.spawned_at[0],
                now - spawned,
            )

    def _take_over(self, before: Membership, after: Membership) -> None:
        """When this rank is rank 0 now, the lowest survivor of a lost rank 0: its duties pass here —
        metrics.h5 (every epoch once), TensorBoard, the checkpoint folder's lock; the run folder is the one
        every rank was given at start."""
        if not (after.rank == 0 and before.rank != 0):
            return
        lost = ", ".join(str(before.ranks[r]) for r in after.lost_since(before))
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

    def _move_world(self, before: Membership, after: Membership) -> None:
        """Put the new world where the run's parts read it (reporting, evaluation, checkpoints) and in the
        log lines' ``[rank r/size]``."""
        parts, mpi = self.parts, self.comm.group.native
        rank, size = after.rank, after.size
        local_rank, local_size = rank, size  # the in-process fault double: one node, no MPI
        if mpi is not None:
            from mpi4py import MPI

            local = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            local_rank, local_size = local.rank, local.size
            local.Free()
        world = dataclasses.replace(
            parts.world, rank=rank, size=size, local_rank=local_rank, local_size=local_size, mpi=mpi
        )
        parts.reporter.world = world  # the run's one view (the reporter records a change of size)
        parts.world = world  # the same view in a run; a test double's own
        level = logging.INFO if rank == 0 else logging.WARNING
        if mpi is not None:  # a process per rank (not the in-process fault double)
            setup_logging(rank, size, level)
        saver = parts.checkpoints.saver
        if saver is not None:
            parts.checkpoints.saver = Checkpointer(saver.directory, rank, size, saver.keep, mpi)


def elastic_obstacle(config: Config, rule: Rule, world: World) -> str | None:
    """What rules elastic training out for this run (one line), or None when nothing does."""
    comm = config.comm
    if world.mpi is None:
        return "this process runs without MPI"
    missing = ulfm_missing()
    if missing is not None:
        return missing
    if comm.backend not in ("auto", "mpi"):
        return f"[comm] backend = {comm.backend} cannot shrink; elastic training needs backend mpi"
    if comm.shared_memory == "on":
        return (
            "[comm] shared_memory = on polls node-shared memory, where a dead rank is waited for forever; "
            "elastic training needs shared_memory = off or auto (auto is off when elastic)"
        )
    return rule.elastic_obstacle(snapshots=config.checkpoint.enabled or config.checkpoint.on_signal)


def resolve_elastic(config: Config, rule: Rule, world: World) -> bool:
    """Whether this run is elastic; ConfigError (exit 2 on every rank, through ``agree``) when
    ``elastic = true``, or ``replace = true``, cannot be honoured."""
    elastic = decide(config, rule, world)
    check_replace(config, rule, elastic)
    return elastic


def decide(config: Config, rule: Rule, world: World) -> bool:
    """``[elastic] enabled`` decided: true, false, or auto's choice (said in one line)."""
    wanted = config.elastic.enabled
    if wanted is False:
        return False
    obstacle = elastic_obstacle(config, rule, world)
    if obstacle is None:
        return True
    if wanted is True:
        raise ConfigError(f"[elastic] enabled = true: {obstacle}")
    if world.rank == 0:
        log.info("[elastic] enabled = auto: not elastic (%s); a lost rank ends the job", obstacle)
    return False
