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

What it refuses, each in one line before training (exit status 2 on every rank): an MPI without ULFM
(MPICH: it names what to install), an Open MPI job started without ``--with-ft ulfm``, a process without
MPI, an asynchronous rule (its servers and peers forget a lost rank only under crossbow-launch's run
modes), and ``precision='fp16'`` (the overflow agreement is not a committed collective yet).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..comm.base import Communicator
from ..comm.elastic import elastic_over_mpi
from ..config.fields import build
from ..config.sections import CommSection, ElasticSection
from ..errors import ConfigError, UsageError
from ..launch.world import World
from ..rules.base import Rule
from ..training.elastic.fault_tolerance import FaultTolerance, Stateful
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


def tolerant(
    section: ElasticSection,
    comm: CommSection,
    world: World,
    rule: Rule,
    state: Sequence[Stateful],
    follow: Callable[[int, int, Any], None],
) -> tuple[Communicator, FaultTolerance]:
    """The job's elastic communicator over ``world`` and the one owner of ``rule``'s fault tolerance:
    ``state`` is what a dropped window restores (the model and optimizer, the rule, what ``xb.keep`` was
    given), ``follow(rank, size, mpi)`` moves the API's world on after a loss (``mpi``: the survivors'
    mpi4py communicator, for the API's own collectives). The copy to restore is refreshed as each
    window starts (the user's code runs between windows)."""
    elastic = elastic_over_mpi(comm, world.device, world.mpi)
    tolerance = FaultTolerance(elastic, rule, state, section.min_ranks, section.commit_every, refresh=True)
    tolerance.followers.append(lambda _, after: follow(after.rank, after.size, elastic.group.native))
    return elastic, tolerance


def elastic_section(elastic: bool | str | Mapping[str, Any], world: World) -> ElasticSection | None:
    """``xb.init(elastic=...)`` checked: None when off; the ``[elastic]`` settings when on (``True``, or a
    mapping of ``min_ranks`` and ``commit_every``); a UsageError naming what rules it out. ``"auto"``:
    elastic where nothing rules it out, else off, said in one line (``[elastic] enabled = auto``'s
    behaviour). Local: no other rank takes part (it runs inside ``xb.init``'s agreement)."""
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
    if given.get("replace"):
        raise UsageError(
            "xb.init(elastic={'replace': True}): the embedded API does not spawn replacements; the job goes "
            "on with the survivors (crossbow-launch's [elastic] replace does)"
        )
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
