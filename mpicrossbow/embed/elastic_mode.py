"""The embedded API's elastic mode, ``xb.init(elastic=True)``: your own loop goes on after a rank is lost.

Under Open MPI with ULFM (``mpiexec --with-ft ulfm``), ``xb.distribute`` builds the run's one owner of fault
tolerance (:class:`~mpicrossbow.training.elastic.fault_tolerance.FaultTolerance`) over an elastic
communicator, as ``crossbow-launch`` does with ``[elastic] enabled = true``; the step hooks around the user's
``optimizer.step()`` (:mod:`.step_hooks`) run each step under it. BSP (grad mode), SMA, LOCALSGD and DILOCO
heal from a peer: nothing is committed per step, and after a loss the survivors take the state of the one
that got furthest and drop the one step they met it in (a step that met it hands your ``optimizer.step()``
no gradient). Other rules commit the steps in windows of ``commit_every``. A rank that
meets a lost rank inside a window goes through the window's remaining steps without exchanging; at the
window's end the survivors agree that it did not complete, shrink to themselves, and restore what they held
at the last commit: the model and optimizer (:class:`ModelState`), the rule's state, and every object given
to ``xb.keep`` (an lr scheduler: any object with ``state_dict`` and ``load_state_dict``). The window's steps
are dropped — their batches are not trained again; each survivor's loader goes on, as crossbow-launch's
does — and rank 0 logs one line naming the lost rank. ``xb.consensus`` and ``xb.finish`` are committed
collectives, redone over the survivors when a rank is lost during them.

``xb.init(elastic={"replace": True})`` starts a replacement for each lost rank (:class:`LoopTolerance`, over
the protocol of :mod:`mpicrossbow.training.elastic.replacement`): the survivors spawn it and train on; it runs
the user's script from its top, its ``xb.init`` merging with them (:func:`join_world`) and its
``xb.distribute`` joining their communicator, binding and handover (:func:`join_rule`), and its loop goes on
at theirs (:mod:`.loop_position`: ``xb.epochs`` and the loaders of ``xb.shard``).

What it refuses, each in one line before training (exit status 2 on every rank): an MPI without ULFM
(MPICH: it names what to install), an Open MPI job started without ``--with-ft ulfm``, a process without
MPI, an asynchronous rule (its servers and peers forget a lost rank only under crossbow-launch's run
modes), and ``precision='fp16'`` (the overflow agreement is not a committed collective yet).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..comm.base import Communicator
from ..comm.elastic import ElasticCommunicator, elastic_over_mpi
from ..comm.membership import Membership
from ..config.fields import build
from ..config.sections import CommSection, ElasticSection
from ..errors import ConfigError, UsageError
from ..launch.finalize_fence import bound_finalize
from ..launch.world import World, detect_world, mpi_threads_ok
from ..rules.base import Rule
from ..training.elastic.fault_tolerance import FaultTolerance, Stateful
from ..training.elastic.replacement import (
    BackgroundSpawn,
    Offer,
    Replacements,
    connect,
    merge_with_survivors,
    receive_handover,
    replaced_rank,
)
from .loop_position import LoopPosition, Position
from .own_model import OwnModel

log = logging.getLogger(__name__)


class ModelState:
    """The user's model and optimizer as one ``state_dict``: what a dropped window restores of them."""

    def __init__(self, own: OwnModel) -> None:
        self.own = own

    def state_dict(self) -> dict[str, Any]:
        """The module's and the optimizer's own ``state_dict``."""
        learner = self.own.learner
        return {"module": learner.module.state_dict(), "optimizer": learner.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Both back (the module's parameters in place: they stay views of the rule's flat buffer)."""
        learner = self.own.learner
        learner.module.load_state_dict(state["module"])
        learner.optimizer.load_state_dict(state["optimizer"])


class LoopTolerance(FaultTolerance):
    """The one owner of fault tolerance in the user's own loop (the copy to restore is refreshed as each
    window starts: the user's code runs between windows), and with ``replace`` a replacement for each lost
    rank, admitted between two optimizer steps where ``loop`` can tell it where to go on
    (:mod:`.loop_position`; the protocol: :mod:`mpicrossbow.training.elastic.replacement`)."""

    def __init__(
        self,
        comm: ElasticCommunicator,
        rule: Rule,
        own: OwnModel,
        state: Sequence[Stateful],
        section: ElasticSection,
        loop: LoopPosition,
        tracebacks: Path,
        steps_done: int = 0,
        threaded: bool = True,
    ) -> None:
        every = section.commit_every
        super().__init__(comm, rule, state, section.min_ranks, every, steps_done, refresh=True)
        self.own, self.loop, self.tracebacks = own, loop, tracebacks
        #: ``replace``: the replacements (started on a thread of their own where MPI is ``threaded``).
        self.replacements = (
            Replacements(self, threaded, section.max_replacements) if section.replace else None
        )

    def before_step(self, position: Callable[[], dict[str, Any]]) -> None:
        """Between two optimizer steps (``position()["step"]``: the next one): start the replacements, and
        admit them where every survivor's start is done and the loop can be joined (:meth:`Replacements.due`,
        :meth:`LoopPosition.where`)."""
        replacements = self.replacements
        if replacements is None or not (replacements.vacancies or replacements.spawning):
            return
        if self.loop.epoch_index is None and replacements.spawning is None:
            if self.comm.membership.rank == 0:
                log.warning(
                    "elastic: no replacement for start rank(s) %s: a replacement runs your script from its "
                    "top and goes on at your loop's epoch, which only a `for epoch in xb.epochs(...)` loop "
                    "tells it; training goes on with %d rank(s)",
                    ", ".join(map(str, replacements.vacancies)),
                    self.comm.membership.size,
                )
            replacements.vacancies = ()
            return
        step = int(position()["step"])
        where = self.loop.where(step)
        if where is None:  # an epoch's end: the user's own collectives follow (validation)
            return
        spawning = replacements.due(step)
        if spawning is not None:
            self.admit(spawning, where)

    def admit(self, spawning: BackgroundSpawn, where: Position) -> None:
        """Go on with the replacements ``spawning`` started, from the loop's position ``where``. Collective
        over the survivors, then the grown world."""
        assert self.replacements is not None
        rule, comm = self.rule, self.comm
        self.replacements.admit(
            spawning, str(self.tracebacks), where, lambda: rule.bind(comm, self.own), self.own
        )

    def settle(self, where: str) -> None:
        """Replacements still starting when training ends are told so and leave, then the owner's settle."""
        if self.replacements is not None:
            self.replacements.cancel()
        super().settle(where)


def tolerant(
    section: ElasticSection,
    comm: CommSection,
    world: World,
    rule: Rule,
    own: OwnModel,
    state: Sequence[Stateful],
    follow: Callable[[int, int, Any], None],
    loop: LoopPosition,
    tracebacks: Path,
    offer: Offer | None = None,
) -> tuple[Communicator, FaultTolerance]:
    """The job's elastic communicator over ``world`` and the one owner of ``rule``'s fault tolerance over
    ``own``: ``state`` is what a dropped window restores (the model and optimizer, the rule, what
    ``xb.keep`` was given), ``follow(rank, size, mpi)`` moves the API's world on after a loss or a
    replacement (``mpi``: the members' mpi4py communicator, for the API's own collectives); ``loop`` and
    ``tracebacks`` are what a replacement is told. ``offer``: on a replacement, the survivors' (its
    communicator is built as theirs grew, and it goes on from their step)."""
    membership = None
    if offer is not None:
        membership = Membership(offer.version, offer.ranks, world.rank, offer.hosts)
    elastic = elastic_over_mpi(comm, world.device, world.mpi, membership=membership)
    step = int(offer.position["step"]) if offer is not None else 0
    threaded = mpi_threads_ok(world)
    tolerance = LoopTolerance(elastic, rule, own, state, section, loop, tracebacks, step, threaded)
    tolerance.followers.append(lambda _, after: follow(after.rank, after.size, elastic.group.native))
    if offer is not None:  # as the survivors' followers did when the world grew: the API's communicator
        follow(world.rank, world.size, elastic.group.native)
    return elastic, tolerance


def replacing() -> bool:
    """Whether this process is a replacement that elastic training's survivors spawned (it joins them)."""
    return replaced_rank() is not None


def join_world() -> tuple[World, Offer]:
    """A replacement's ``xb.init`` (:data:`~mpicrossbow.training.elastic.replacement.REPLACES` set): MPI
    started (a COMM_WORLD of its own), merged with the survivors that spawned it, greeted, and their offer
    received. The world it trains in (its rank and size among them, its node's ranks counted from the
    offer's hosts: nothing collective beyond the protocol) and the offer. When training ended while it
    started, it leaves (status 0)."""
    from mpi4py import MPI

    alone = detect_world(threads=True)
    merged = merge_with_survivors()
    connect(merged, merged.Get_size() - MPI.COMM_WORLD.Get_size())
    offer: Offer | None = merged.bcast(None, root=0)
    if offer is None:
        log.warning("elastic: the run ended before the replacement of start rank %s joined", replaced_rank())
        bound_finalize()
        raise SystemExit(0)
    rank, here = merged.Get_rank(), offer.hosts[merged.Get_rank()]
    world = dataclasses.replace(
        alone,
        rank=rank,
        size=merged.Get_size(),
        local_rank=offer.hosts[:rank].count(here),
        local_size=offer.hosts.count(here),
        mpi=merged,
    )
    return world, offer


def join_rule(rule: Rule, comm: Communicator, own: OwnModel, merged: Any) -> tuple[Any, ...]:
    """A replacement's side of the binding and the handover, after its communicator ``comm``
    (:func:`tolerant`): ``rule`` bound with the survivors (collective), rank 0's handover received over
    ``merged`` and installed — the model and optimizer, the rule's state, the learner at the consensus. The
    states left over: those of the ``xb.keep`` objects the script makes after this, in its order."""
    rule.bind(comm, own)
    return receive_handover(merged).install([ModelState(own), rule], own.learners)


def elastic_section(elastic: bool | str | Mapping[str, Any], world: World) -> ElasticSection | None:
    """``xb.init(elastic=...)`` checked: None when off; the ``[elastic]`` settings when on (``True``, or a
    mapping of ``min_ranks``, ``commit_every``, ``replace`` and ``max_replacements``); a UsageError naming
    what rules it out. ``"auto"``: elastic where nothing rules it out, else off, said in one line
    (``[elastic] enabled = auto``'s behaviour). Local: no other rank takes part (it runs inside
    ``xb.init``'s agreement)."""
    if elastic is False:
        return None
    if elastic == "auto":
        obstacle = _obstacle(world)
        if obstacle is None:
            return ElasticSection(enabled=True)
        if world.rank == 0:
            log.info("xb.init(elastic='auto'): not elastic (%s); a lost rank ends the job", obstacle)
        return None
    given = {} if elastic is True else dict(elastic) if isinstance(elastic, Mapping) else None
    if given is None:
        raise UsageError(f"xb.init(elastic={elastic!r}): True, False, 'auto', or a dict of [elastic] keys")
    try:
        section = build(ElasticSection, {**given, "enabled": True}, "elastic")
    except ConfigError as exc:
        raise UsageError(f"xb.init(elastic=...): {exc}") from None
    obstacle = _obstacle(world)
    if obstacle is not None:
        raise UsageError(f"xb.init(elastic=True): {obstacle}")
    return section


def _obstacle(world: World) -> str | None:
    """What rules elastic training out in this process (one line), or None."""
    if world.mpi is None:
        return "this process runs without MPI; start the script with mpiexec --with-ft ulfm"
    from ..comm.ulfm import ulfm_missing

    return ulfm_missing()


def check_rule(rule: Rule, precision: str) -> None:
    """``xb.distribute`` under ``xb.init(elastic=True)``: a UsageError for what the embedded elastic mode
    does not take (see the module doc)."""
    if not rule.synchronous:
        raise UsageError(
            f"xb.distribute(rule={rule.name!r}) under xb.init(elastic=True): the embedded API's elastic mode "
            "takes the synchronous rules (BSP, SMA, EASGD, LOCALSGD, ...); crossbow-launch's [elastic] runs "
            "the asynchronous ones"
        )
    obstacle = rule.elastic_obstacle()
    if obstacle is not None:
        raise UsageError(f"xb.distribute(rule={rule.name!r}) under xb.init(elastic=True): {obstacle}")
    if precision == "fp16":
        raise UsageError(
            "xb.distribute(precision='fp16') under xb.init(elastic=True): fp16's overflow agreement is not "
            "fault tolerant; use precision='bf16'"
        )


def check_keepable(obj: object) -> None:
    """``xb.keep(obj)``: a UsageError unless ``obj`` has ``state_dict`` and ``load_state_dict``."""
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise UsageError(
            f"xb.keep({type(obj).__name__}): keep objects with state_dict() and load_state_dict() (an lr "
            "scheduler, a GradScaler, your own counters)"
        )
