"""``[elastic] enabled``: whether this run goes on after losing a rank, decided once per rank before training.

``false`` (the default): a lost rank ends the job, which resumes from its checkpoints — today's behaviour,
bit for bit, and no per-step cost. ``true``: elastic or nothing — anything that rules it out (an MPI without
ULFM, a job started without ``--with-ft ulfm``, a communicator or rule that cannot follow a shrinking world)
is one line and exit status 2 on every rank before training. ``auto``: elastic where all of that holds, else
``false``'s behaviour, said in one line. Nothing here talks to another rank (it runs in ``prepare_local``).
"""

from __future__ import annotations

import logging

from ...comm.ulfm import ulfm_missing
from ...config import Config
from ...errors import ConfigError
from ...launch.world import World
from ...rules.base import Rule
from .replacement import check_replace

log = logging.getLogger(__name__)


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
