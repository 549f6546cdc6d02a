"""Replica groups (``[link] groups`` > 1): each node's MPI job trains as a group, the rules' exchanges
joined across the groups by :class:`~mpicrossbow.comm.linked.LinkedCommunicator`, so a lost node costs its
group and the others train on (issue 52: Open MPI 5.0 ends every rank of a job that loses a node).

What a group is to the rest of the run: its own MPI job (its world: checkpoints, metrics, the watchdog,
its run folder ``<name>-group<g>``), training the data shard of its ranks' places in the whole (group ``g``'s
rank ``r`` reads shard ``g × size + r`` of ``groups × size``), and exchanging through the linked
communicator. The rules whose exchange is an allreduce or a broadcast run across groups; those that send
point to point or split the world are refused here, in one line, before training.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from ..comm.base import Communicator, ReduceOp
from ..comm.group_link import GroupLink
from ..comm.linked import LinkedCommunicator
from ..config import Config
from ..errors import ConfigError
from ..launch.world import World
from ..rules.base import Rule

log = logging.getLogger(__name__)

#: The environment that names a job's group and the rendezvous (launch/slurm/groups.sbatch sets them).
GROUP_ENV, ADDRESS_ENV = "CROSSBOW_GROUP", "CROSSBOW_LINK_ADDRESS"
#: A file group 0's first rank appends ``<group> <host>`` to for each group it finds lost: where
#: launch/slurm/groups.sbatch learns, within seconds, which group to start again on a spare node (a lost
#: node's srun may wait minutes for Slurm to declare the node down).
LOST_FILE_ENV = "CROSSBOW_LOST_GROUPS_FILE"
#: The rules whose exchanges are allreduces and broadcasts only: they run across replica groups.
LINKABLE = ("BSP", "SMA", "LOCALSGD", "DILOCO")


def resolve_link(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    """``config`` with ``[link] group`` and ``address`` filled in from the environment where unset; a
    ConfigError naming what is missing or wrong. Unchanged with ``groups = 1``."""
    link = config.link
    if link.groups == 1:
        return config
    env = os.environ if environ is None else environ
    group, address = link.group, link.address or env.get(ADDRESS_ENV, "")
    if group < 0:
        raw = env.get(GROUP_ENV, "")
        if not raw.isdigit():
            raise ConfigError(
                f"[link] groups = {link.groups} needs this job's group: set [link] group or {GROUP_ENV} "
                f"(0..{link.groups - 1}){f', not {raw!r}' if raw else ''}"
            )
        group = int(raw)
    if group >= link.groups:
        raise ConfigError(f"[link] group = {group}, but groups = {link.groups} (0..{link.groups - 1})")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"[link] groups = {link.groups} needs the rendezvous as host:port ([link] address or "
            f"{ADDRESS_ENV}; group 0's first rank listens there){f', not {address!r}' if address else ''}"
        )
    return dataclasses.replace(config, link=dataclasses.replace(link, group=group, address=address))


def check_linked(config: Config, rule: Rule) -> None:
    """One ConfigError for the first setting that does not go with replica groups."""
    if config.link.groups == 1:
        return
    if rule.name not in LINKABLE:
        raise ConfigError(
            f"RULE={rule.name} cannot run across replica groups ([link] groups = {config.link.groups}): it "
            f"sends point to point or splits the world; the rules that can: {', '.join(LINKABLE)}"
        )
    if config.elastic.enabled is True or config.elastic.replace:
        raise ConfigError(
            "[link] groups > 1 with [elastic]: a group is what is lost and survived; within a group a lost "
            "rank ends that group. Set [elastic] enabled = false"
        )
    if config.pool.learners == "auto":
        raise ConfigError("[link] groups > 1 needs a number of learners ([pool] learners), not auto")
    if config.checkpoint.resume:
        raise ConfigError(
            "[checkpoint] resume with [link] groups > 1: the groups' folders may hold different steps; "
            "resume one group's run folder with [link] groups = 1"
        )


def shard_world(world: World, config: Config) -> World:
    """The world the data shards follow: this rank's place among every group's ranks."""
    groups = config.link.groups
    if groups == 1:
        return world
    rank = config.link.group * world.size + world.rank
    return dataclasses.replace(world, rank=rank, size=groups * world.size)


def record_lost(groups: Mapping[int, str]) -> None:
    """Append ``<group> <host>`` for each lost group to ``$CROSSBOW_LOST_GROUPS_FILE``, when set."""
    path = os.environ.get(LOST_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as file:
            file.writelines(f"{g} {host}\n" for g, host in groups.items())
    except OSError as exc:  # training goes on; only the template's restart is missed
        log.warning("link: could not record the lost group(s) in %s (%s)", path, exc)


def join_groups(inner: Communicator, config: Config) -> Communicator:
    """``inner`` joined to the other groups (collective over every group's ranks): the group's rank 0
    connects the link (group 0's starts the rendezvous; a group whose job was restarted after its loss asks
    to join the run under way, :mod:`..returning_group`); a ConfigError on every rank when the groups'
    sizes differ. ``inner`` itself with ``groups = 1``."""
    link = config.link
    if link.groups == 1:
        return inner
    host, _, port = link.address.rpartition(":")
    leader = None
    if inner.rank == 0:  # admit: a group back takes a peer's state (..returning_group)
        leader = GroupLink(
            host, int(port), link.group, link.groups, link.dead_after_s, admit=True, on_lost=record_lost,
            restarted=link.restarted,
        )  # fmt: skip
    linked = LinkedCommunicator(inner, leader, link.group, link.groups)
    if linked.joining:  # its sums start where the others are, at its first step
        return linked
    most, fewest = linked.allreduce_scalars([float(inner.size), -float(inner.size)], ReduceOp.MAX)
    if most != -fewest:
        raise ConfigError(
            f"[link] groups = {link.groups}: the groups have {int(-fewest)} to {int(most)} ranks; start each "
            "group's job with as many"
        )
    return linked
