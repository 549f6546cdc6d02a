"""Settings that do not go together with the chosen rule, checked once per rank before training.

Each is one ConfigError naming both settings (exit status 2 on every rank, through ``agree``), so a job that
could only fail later — an asynchronous rule asked to stop at a target accuracy, learners = auto with an
asynchronous rule — stops before it starts. Nothing here talks to another rank.
"""

from __future__ import annotations

from ...config import Config
from ...errors import ConfigError
from ...launch.world import World, mpi_threads_ok
from ...rules.base import Rule
from ..replica_groups import check_linked
from ..reporting.tensorboard_log import check_available as check_tensorboard


def check_combinations(config: Config, rule: Rule, world: World) -> None:
    """One ConfigError for the first setting that does not go with ``rule`` (elastic training's own: its
    :func:`~mpicrossbow.training.elastic.run_tolerance.resolve_elastic`)."""
    check_linked(config, rule)
    if config.pool.learners == "auto" and not rule.synchronous:
        raise ConfigError(
            f"[pool] learners = auto needs a synchronous rule (every rank must change its learner count "
            f"at the same step); RULE={config.rule} is asynchronous: set [pool] learners to a number"
        )
    if config.session.target_accuracy and not rule.synchronous:
        raise ConfigError(
            f"[session] target_accuracy needs a synchronous rule (every rank must stop at the same "
            f"step); RULE={config.rule} is asynchronous: set a number of epochs instead"
        )
    if rule.needs_mpi_threads and not mpi_threads_ok(world):
        raise ConfigError(
            f"RULE={config.rule} with [rule] placement = colocated serves from a second thread and needs "
            "MPI_THREAD_MULTIPLE, which this process's MPI was not started with (it starts once per "
            "process): run the job in a process of its own, or use placement = rank"
        )
    if config.session.tensorboard:
        check_tensorboard()
