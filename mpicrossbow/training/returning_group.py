"""A replica group back after its loss (``[link] groups``, issue 52): its job restarted — on the same node, or
a spare one — takes a live group's state at a step's boundary and trains on with the others, so the run is
whole again without a restart of anyone else.

Who sends what to whom (M: every rank of the member groups; J: every rank of the group back; the link's own
protocol, :mod:`mpicrossbow.comm.group_link`, beneath):

1. **J starts** as at the start (its data shard, the rule bound within the group), its leader asking the link
   to join; group 0's leader offers it at a sum, which M's leaders complete as a ``grow``: every rank of M
   learns with that sum's result that a group waits
   (:attr:`~mpicrossbow.comm.linked.LinkedCommunicator.pending`).
2. **At the start of M's next step** (:class:`GroupReturns`, the run's window; every rank of M at the same
   step, since they sum in lockstep): the rule's ``sync_state`` (collective over M, J not in yet), then the
   lowest member group's leader packs what a checkpoint holds — the pool's state (replicas, optimizer
   state), the rule's, the consensus weights (the rule's ``eval_params``, learner 0's for BSP) and the
   loop's position — M's leaders admit J in a new era, and that leader hands the bytes to J's leader over
   the link (a Gloo broadcast).
3. **J takes it** (:func:`take_group_state`, after its rule's binding): its leader passes the bytes to its
   group (an MPI broadcast), every rank of J loads them and sets every learner to the consensus (as an
   elastic replacement does), and its loop goes on from the position: the same step as M, every sum from
   there over every group.

J's own run folder (``<name>-group<g>``) holds the epochs it trained after it joined.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..comm.base import Communicator
from ..comm.linked import LinkedCommunicator
from ..errors import ConfigError
from ..launch.world import World
from ..pool.base import LearnerPool
from ..rules.base import Rule
from .checkpoints.checkpoint_manager import CheckpointManager
from .run.window import ForwardingWindow, StepWindow

log = logging.getLogger(__name__)


def pack_state(pool: LearnerPool, rule: Rule, position: dict[str, Any], group_size: int) -> bytes:
    """What a group back takes (after the rule's ``sync_state``): the pool's and the rule's state, the
    consensus weights, the loop's ``position`` and the source group's rank count, serialized."""
    held = rule.eval_params()
    consensus = held if held is not None else pool.learners[0].params
    state = {
        "pool": pool.state_dict(),
        "rule": rule.state_dict(),
        "consensus": consensus.detach().cpu(),
        "position": position,
        "group_size": group_size,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class GroupReturns(ForwardingWindow):
    """The members' side (step 2 of the module doc): ``inner``, the run's window, with a group back let in at
    the start of the first step after a sum said it waits."""

    def __init__(self, inner: StepWindow, comm: LinkedCommunicator, pool: LearnerPool, rule: Rule) -> None:
        super().__init__(inner)
        self.comm, self.pool, self.rule = comm, pool, rule

    def before_step(self, position: Callable[[], dict[str, Any]]) -> None:
        """Admit the groups waiting, if any (collective over the members' ranks), then the inner window's."""
        if self.comm.pending:
            self._admit(position())
        self.inner.before_step(position)

    def _admit(self, position: dict[str, Any]) -> None:
        started, sizes = time.perf_counter(), []
        self.rule.sync_state()

        def state() -> bytes:
            sizes.append(len(payload := pack_state(self.pool, self.rule, position, self.comm.inner.size)))
            return payload

        joined = self.comm.admit_pending(state)
        if joined and sizes:  # the source group's leader
            log.warning(
                "link: group(s) %s back at step %d (epoch %d): group %d handed over its state (%.1f MB) in "
                "%.2f s; %d group(s) train",
                ", ".join(map(str, joined)), position["step"], position["epoch"] + 1, self.comm.group,
                sizes[0] / 1e6, time.perf_counter() - started, len(self.comm.groups),
            )  # fmt: skip


def returning(window: StepWindow, comm: Communicator, pool: LearnerPool, rule: Rule) -> StepWindow:
    """The run's ``window``, letting groups back in when ``comm`` links replica groups."""
    return GroupReturns(window, comm, pool, rule) if isinstance(comm, LinkedCommunicator) else window


def take_group_state(
    comm: Communicator, world: World, pool: LearnerPool, rule: Rule, checkpoints: CheckpointManager
) -> None:
    """The joining side (step 3 of the module doc), after the rule's binding; nothing unless ``comm`` is a
    group back to a run under way. Collective over the group (``world``)."""
    if not (isinstance(comm, LinkedCommunicator) and comm.joining):
        return
    started = time.perf_counter()
    data = world.bcast(comm.take_state())
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if state["group_size"] != world.size:  # its data shards would overlap the others'
        raise ConfigError(
            f"[link] groups: group {comm.group} came back with {world.size} rank(s), the others have "
            f"{state['group_size']}; start each group's job with as many"
        )
    pool.load_state_dict(state["pool"])
    rule.load_state_dict(state["rule"])
    for learner in pool.learners:  # the consensus, as a replacement's (its replicas may have differed)
        learner.params.copy_(state["consensus"])
    position = state["position"]
    checkpoints.adopt(position)
    if world.rank == 0:
        log.warning(
            "link: group %d back at step %d (epoch %d), its state from a peer (%.1f MB in %.2f s); %d "
            "group(s) train",
            comm.group, position["step"], position["epoch"] + 1, len(data) / 1e6,
            time.perf_counter() - started, len(comm.groups),
        )  # fmt: skip
