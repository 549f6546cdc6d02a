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
from collections.abc import Callable
from typing import Any

from ...comm.elastic import ElasticCommunicator
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
from .replacement import check_replace

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
        max_replacements: int = 3,
    ) -> None:
        steps_done = int(parts.checkpoints.position.get("step", 0))
        state = [parts.pool, parts.rule]
        super().__init__(comm, parts.rule, state, min_ranks, every, steps_done, heals=heals)
        self.parts = parts
        #: ``[elastic] replace``: a lost rank gets a replacement at the next step (:meth:`before_step`).
        self.replacements = (
            replacement.Replacements(self, mpi_threads_ok(parts.world), max_replacements) if replace else None
        )
        self.followers += [self._move_world, self._take_over]

    @classmethod
    def configured(cls, parts: RankParts, comm: ElasticCommunicator, section: ElasticSection) -> RunTolerance:
        """The run's fault tolerance as ``[elastic]`` (``section``) sets it."""
        return cls(
            parts,
            comm,
            section.min_ranks,
            section.commit_every,
            section.replace,
            max_replacements=section.max_replacements,
        )

    def before_step(self, position: Callable[[], dict[str, Any]]) -> None:
        """``[elastic] replace``: the replacements start on a thread at the first step after a recovery that
        every survivor trains, and join at the first window's start where every survivor's thread is done
        (:meth:`~.replacement.Replacements.due`), the survivors training until then."""
        if self.replacements is None or not (self.replacements.vacancies or self.replacements.spawning):
            return
        where = position()
        spawning = self.replacements.due(int(where["step"]))
        if spawning is not None:
            self.admit(spawning, where)

    def settle(self, where: str) -> None:
        """Replacements still starting when training ends are told so and leave, then the owner's settle."""
        if self.replacements is not None:
            self.replacements.cancel()
        super().settle(where)

    def pause_orders(self, world: World) -> PauseOrders:
        """Snapshots that go on after a loss: the control plane over a fault-tolerant group of its own."""
        return ElasticPauseOrders(self.parts, self.comm)

    def admit(self, spawning: replacement.BackgroundSpawn, position: dict[str, Any]) -> None:
        """Go on with the replacements ``spawning`` started, from ``position`` (at the start of a step, no
        window open; the protocol: :mod:`.replacement`). Collective over the survivors, then the grown
        world."""
        assert self.replacements is not None and not self.pending, "replacements join at a window's start"
        parts, comm = self.parts, self.comm
        bind = lambda: parts.rule.bind(comm, parts.pool)  # noqa: E731
        self.replacements.admit(spawning, str(parts.reporter.run_dir), position, bind, parts.pool)

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


def server_backups(config: Config, rule: Rule, elastic: bool) -> int:
    """``[elastic] server_backups`` for this run; ConfigError when it cannot be honoured."""
    wanted = config.elastic.server_backups
    if not wanted:
        return 0
    head = f"[elastic] server_backups = {wanted}"
    if not elastic:
        raise ConfigError(f"{head} needs elastic training ([elastic] enabled = true, an MPI with ULFM)")
    obstacle = rule.backups_obstacle()
    if obstacle is not None:
        raise ConfigError(f"{head}: {obstacle}")
    return wanted
