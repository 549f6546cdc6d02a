"""GSP — grouping synchronous parallel (MXNet-G's Grouping-SGD).

Who sends what to whom, and when: ranks 0..S-1 serve the model as for ASGD
(:mod:`mpicrossbow.rules.parameter_server`); the workers are split into **groups** (a groups file, or
``groups = auto``: by speed, see :mod:`mpicrossbow.rules.grouping`; empty: one group of all workers).
Inside a group every step is synchronous: one allreduce over the group's ranks averages the gradients of all
its learners (BSP gradient mode), so a group's replicas stay identical. Across groups it is asynchronous:
every τ steps the group's first rank (its leader) pushes the group's progress ``Δ = x − x_pulled`` to the
servers and broadcasts the reply, the current w, to its group. The server applies the push with a staleness
weight: ``w ← w + scale · Δ / Y_G``, ``Y_G = 1 + (updates the server applied since the w this group last
pulled)`` — 1 for a group nobody overtook, larger for a group whose progress was computed from older
weights. A slow rank in a group of its own therefore never holds the fast groups, and its stale work
counts less.

``groups = auto``: the workers first train as one group for ``probe_steps`` steps, timing their own work
per step (waits for the group excluded); then they agree on everyone's median, form groups by
:func:`~mpicrossbow.rules.grouping.group_by_speed` and go on from the same pulled w. ``shares``: a
data-sharding file (one ``start end`` fraction per rank) that replaces the equal shards; ranks of one group
must hold the same number of batches per epoch (checked at the start).

Elastic training (``[elastic] enabled``): each group talks over a fault-tolerant group of its own (split off
the run's, :meth:`~mpicrossbow.comm.elastic.FaultTolerantGroup.split`), so a loss inside one group revokes
that group only — the servers and the other groups go on. Every group step (the gradient average, the pull's
broadcasts) ends with a fault-tolerant agreement among the group's ranks that it completed on all of them.
When it did not (a member died: the survivors' collective raised
:class:`~mpicrossbow.comm.ulfm.PeerLost`, or it completed on some and the agreement sees the death), the
survivors shrink the group, and nobody keeps the partial step: each restores its own gradients (copied
before the average) and the average is done again over the survivors — the lost rank's batch is dropped,
the survivors' replicas stay bitwise identical. The lowest survivor leads the group (rank 0 of the shrunk
group): a leader lost in the pull is replaced by it, and it pushes the group's Δ itself (if the lost leader's
push had reached the servers, that progress counts twice, the second time with weight 1/Y ≤ 1/2); a leader
that survived re-broadcasts the w it already adopted. Non-leaders adopt w only after the agreement. The
servers forget a lost worker as for ASGD (:meth:`ParameterServer.forget`: done for good); a lost server ends
the job (ElasticEnd). The lost rank's data shard is dropped; the run's end meets as for the other
asynchronous rules (``FaultTolerance.settle``). ``groups = auto`` is not elastic: the speed probe runs all
workers as one group and re-splits them from an agreement over all of them mid-run, which a loss would have
to re-run (refused at start).
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

from ..comm.base import Communicator, ReduceOp
from ..comm.elastic import ElasticCommunicator, until_committed
from ..config.fields import setting
from ..errors import ConfigError
from .grouping import group_by_speed, group_of, read_groups, read_shares
from .parameter_server import ParameterServer, Policy, ServerConfig, ServerRule
from .registry import RULES
from .request_loop import UPDATE

log = logging.getLogger(__name__)


class GroupStaleness(Policy):
    """Weight a push by ``1/Y``, Y = 1 + updates applied since the w its group last pulled."""

    def weight(self, server: ParameterServer, r: int) -> float:
        """``1 / (1 + updates − seen_r)``."""
        return 1.0 / (1 + server.updates - server.seen[r])


def hostnames() -> set[str]:
    """This host's names as a groups file may write them (full and short)."""
    name = socket.gethostname()
    return {name, name.split(".")[0]}


@RULES.register("GSP")
class GSP(ServerRule):
    """Synchronous groups of workers, asynchronous across groups with MXNet-G's 1/Y staleness weight."""

    #: A group averages its gradients before the local step.
    needs_gradients = True
    #: The servers forget a lost worker; a lost group member is recovered from inside its group.
    forgets_workers: ClassVar[bool] = True

    @dataclass(frozen=True)
    class Config(ServerConfig):
        """GSP hyper-parameters."""

        groups: str = setting(
            "", "groups file (a group per line: ranks or host names), auto (by measured speed), or empty: one"
        )
        shares: str = setting("", "data-sharding file: one 'start end' fraction pair per rank, or empty")
        tau: int = setting(1, "a group's leader pushes Δ and pulls w every τ steps", ge=1)
        scale: float = setting(
            1.0, "the server applies w ← w + scale·Δ/Y (0: 1 / all workers' learners)", ge=0
        )
        probe_steps: int = setting(
            20, "groups = auto: steps timed (as one group) before the groups form", ge=1
        )
        speed_ratio: float = setting(
            1.5, "groups = auto: a worker this much slower than its group's fastest starts a new group", gt=1
        )

    name = "GSP"

    def __init__(self, **hyper: Any) -> None:
        super().__init__(**hyper)
        if self.hyper.groups == "auto" and self.hyper.shares:
            raise ConfigError(
                "[rule] shares needs a groups file: with groups = auto the groups are not known when the "
                "data is sharded"
            )
        self.group: Communicator | None = None
        #: World ranks of every group, once known on this rank (auto: after the probe; file: own group).
        self.group_ranks: list[list[int]] = []
        self._busy: list[float] = []
        self._inside = 0.0
        self._last_end: float | None = None
        #: Elastic training: the group's communicator (``self.group``) as an elastic one, else None.
        self.elastic_group: ElasticCommunicator | None = None
        #: Elastic training: this rank's gradients before the group's average (what a redo starts from).
        self._grads: list[torch.Tensor] = []
        #: Elastic training: the group members lost so far (start ranks), in the order they were met.
        self.lost_members: list[int] = []

    def backups_obstacle(self) -> str | None:
        """GSP's groups are formed over the worker ranks, which backups would move: not yet."""
        return "RULE=GSP's worker groups do not yet leave room for backup ranks; use ASGD or SSP"

    def elastic_obstacle(self, snapshots: bool = False) -> str | None:
        """As the other server rules (server ranks), with a groups file or one group: ``groups = auto`` is
        not elastic. Its snapshots go on after a loss: the group's pause agreement is a committed group
        step."""
        if self.hyper.groups == "auto":
            return (
                "RULE=GSP with [rule] groups = auto is not elastic: its speed probe trains every worker as "
                "one group and re-splits them mid-run from an agreement over all of them, which a lost "
                "worker would break; give a groups file or leave groups empty (one group)"
            )
        return super().elastic_obstacle(snapshots=False)

    # ------------------------------------------------------------------ set-up (no communication)
    def _file_group(self, rank: int, size: int) -> int:
        path = self.hyper.groups
        return group_of(read_groups(path, size, self.servers), rank, hostnames(), path)

    def trains(self, rank: int, size: int) -> bool:
        """Servers serve; a worker checks the groups and shares files name it properly."""
        if not super().trains(rank, size):
            return False
        if self.hyper.groups not in ("", "auto"):
            self._file_group(rank, size)
        self.train_span(rank, size)
        return True

    def train_span(self, rank: int, size: int) -> tuple[float, float] | None:
        """This rank's line of the shares file (None without one: equal shards)."""
        return read_shares(self.hyper.shares, size, self.servers)[rank] if self.hyper.shares else None

    # ------------------------------------------------------------------ binding
    def on_bind(self) -> None:
        """Split the workers into their groups and check a group's ranks take equally many steps."""
        super().on_bind()
        assert self.comm is not None and self.pool is not None
        rank, size = self.comm.rank, self.comm.size
        color = 0 if self.server is not None else 1
        # elastic training: fault-tolerant groups of their own, a loss in one group revokes that group only
        apart = self.comm.split_apart(color)
        if apart is not None and self.hyper.groups == "auto":
            raise ConfigError(self.elastic_obstacle() or "RULE=GSP with groups = auto is not elastic")
        workers = apart if apart is not None else self.comm.split(color)
        if self.server is not None:
            return
        self.workers_comm = workers
        self._seen = torch.zeros(self.shards, dtype=torch.float64)  # the counts the leader broadcasts
        if self.hyper.groups == "auto":
            self.group = workers
            self._probing = True
        else:
            index = self._file_group(rank, size) if self.hyper.groups else 0
            group = workers.split_apart(index) if apart is not None else None
            self.elastic_group = cast("ElasticCommunicator | None", group)
            self.group = group if group is not None else workers.split(index)
            self._probing = False
        self._check_batches()

    def _check_batches(self) -> None:
        assert self.group is not None and self.pool is not None
        mine = float(self.pool.n_batch_train)
        most, fewest = self.group.allreduce_scalars([mine, -mine], op=ReduceOp.MAX)
        if most != -fewest:
            raise ConfigError(
                f"RULE=GSP: the ranks of one group hold {int(-fewest)} to {int(most)} batches per epoch; a "
                "group trains in lock-step, so give its ranks equal shares ([rule] shares)"
            )

    def _compute_delta(self) -> None:
        """The group's progress: learner 0's (every replica of a group is the same)."""
        assert self.pool is not None
        torch.sub(self.pool.learners[0].params, self.pulled, out=self.delta)

    # ------------------------------------------------------------------ hooks
    def on_gradients(self, step: int) -> None:
        """Average gradients over the group's learners (a barrier inside the group)."""
        if self.server is not None:
            return
        start = time.perf_counter()
        if self.elastic_group is None:
            self.average("grads", comm=self.group)
        else:
            self._elastic_average(step)
        self._inside += time.perf_counter() - start

    def _elastic_average(self, step: int) -> None:
        """The group's gradient average as a committed group step: this rank's gradients are copied first,
        so a redo over the survivors starts from them, not from what a partial allreduce left."""
        assert self.pool is not None
        grads = [learner.grads for learner in self.pool.learners]
        if [g.shape for g in self._grads] != [g.shape for g in grads]:
            self._grads = [g.detach().clone() for g in grads]
        else:
            for copy, grad in zip(self._grads, grads, strict=True):
                copy.copy_(grad)

        def average(again: bool) -> None:
            if again:
                for copy, grad in zip(self._grads, grads, strict=True):
                    grad.copy_(copy)
            self.average("grads", comm=self.group)

        self._group_step(average, step, "its gradient average")

    def _group_step(self, work: Callable[[bool], None], step: int, what: str) -> None:
        """Run ``work`` (a group collective; its argument says whether it is a redo) until the group's
        ranks agree it completed on every one of them; after each disagreement the survivors shrink the
        group (:meth:`_regroup`) and do it again over themselves. Collective over the group."""
        group = self.elastic_group
        assert group is not None
        until_committed(work, group.commit, lambda _started: self._regroup(step, what))

    def _regroup(self, step: int, what: str) -> None:
        """Shrink the group to its survivors (revoke, shrink, rebuild: collective over them); its new rank
        0, the lowest survivor, leads it and logs one line naming the lost rank and the step."""
        group = self.elastic_group
        assert group is not None and self.comm is not None
        before = group.membership
        after = group.recover()
        lost = [before.ranks[r] for r in after.lost_since(before)]
        self.lost_members.extend(lost)
        if after.rank == 0:
            leader = before.ranks[0] in after.ranks
            log.warning(
                "GSP rank %d: worker rank(s) %s of group %s lost (start numbering) at step %d (%s); the "
                "group goes on with rank(s) %s, %s",
                self.comm.rank, ", ".join(map(str, lost)), list(before.ranks), step, what, list(after.ranks),
                "its leader kept" if leader else f"rank {after.ranks[0]} leads it now",
            )  # fmt: skip

    def exchange(self, step: int) -> None:
        """Every τ steps the leader pushes, the group adopts the reply; auto groups form after the probe."""
        self.serve_shard()
        self._steps = step + 1
        if self.server is not None:
            return
        start = time.perf_counter()
        probe_ends = self._probing and self._steps == self.hyper.probe_steps
        if self._steps % self.hyper.tau == 0 or probe_ends:
            if self.elastic_group is None:
                self._group_pull()
            else:
                self._elastic_pull(step)
        if probe_ends:
            self._form_groups()
        end = time.perf_counter()
        self._inside += end - start
        if self._last_end is not None and self._probing:
            self._busy.append(end - self._last_end - self._inside)
        self._last_end, self._inside = end, 0.0

    def _group_pull(self) -> None:
        """The leader pushes Δ and pulls w; the group receives w and the update counts seen by broadcast
        (the counts exactly: a compressed exchange must not round them)."""
        assert self.group is not None
        if self.group.rank == 0:
            self._push(UPDATE)
            self._seen.copy_(torch.tensor(self.seen, dtype=self._seen.dtype))
        if self.group.size > 1:
            self.group.broadcast(self.w, root=0).wait()
            self.group.exact.broadcast(self._seen, root=0).wait()
            if self.group.rank != 0:
                self.seen = [int(v) for v in self._seen.tolist()]
                self._adopt()

    def _elastic_pull(self, step: int) -> None:
        """The pull as a committed group step: the leader pushes Δ once and adopts the reply; w and the
        counts go to the group by broadcast; the others adopt them only once the group agreed the broadcasts
        completed everywhere. After a loss the survivors' rank 0 — the same leader, or the lowest survivor
        when the leader was lost — pushes if it has not yet (its replica is the lost leader's: the same Δ)
        and broadcasts again."""
        pushed = False

        def pull(again: bool) -> None:
            nonlocal pushed
            group = self.group
            assert group is not None
            if group.rank == 0 and not pushed:
                self._push(UPDATE)
                pushed = True
                self._seen.copy_(torch.tensor(self.seen, dtype=self._seen.dtype))
            if group.size > 1:
                group.broadcast(self.w, root=0).wait()
                group.exact.broadcast(self._seen, root=0).wait()

        self._group_step(pull, step, "the pull")
        if not pushed:
            self.seen = [int(v) for v in self._seen.tolist()]
            self._adopt()

    def _form_groups(self) -> None:
        """Agree on every worker's median seconds per step and split into groups by speed."""
        assert self.comm is not None
        workers = self.workers_comm
        seconds = torch.zeros(workers.size, dtype=torch.float64)
        seconds[workers.rank] = statistics.median(self._busy) if self._busy else 0.0
        workers.allreduce(seconds).wait()
        index = group_by_speed(seconds.tolist(), self.hyper.speed_ratio)
        world = self.workers
        self.group_ranks = [[world[i] for i, g in enumerate(index) if g == k] for k in range(max(index) + 1)]
        self.group = workers.split(index[workers.rank])
        self._probing = False
        if workers.rank == 0:
            log.info(
                "GSP groups by speed: %s (median s/step %s)",
                self.group_ranks,
                ", ".join(f"{s:.4f}" for s in seconds.tolist()),
            )

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """After the serving ended (the run's end meets only then): nothing to rebuild — the servers forgot
        the lost workers as they met them, and each group shrank inside itself when it met a loss (its
        communicator is its own, untouched by the world's shrink; no group talks after ``finish``)."""

    def agree_pause(self, wanted: bool) -> bool:
        """A group averages every step: its ranks pause for a snapshot at the same step (a 1-value MAX
        allreduce over the group; in elastic training a committed group step, redone over the survivors
        after a loss, as the gradient average is)."""
        group = self.group
        if self.server is not None or group is None or group.size == 1:
            return wanted
        if self.elastic_group is None:
            return group.allreduce_scalars([float(wanted)], op=ReduceOp.MAX)[0] > 0
        agreed = [wanted]

        def agree(_: bool) -> None:
            agreed[0] = group.allreduce_scalars([float(wanted)], op=ReduceOp.MAX)[0] > 0  # swapped in place

        self._group_step(agree, self._steps, "its pause agreement")
        return agreed[0]

    def state_dict(self) -> dict[str, Any]:
        """The parameter-server state, and a worker's group once formed by speed (None while probing)."""
        state = super().state_dict()
        if self.server is None:
            state["group_ranks"] = None if self._probing else self.group_ranks
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore it; groups formed by speed are split again (every worker restores at once)."""
        super().load_state_dict(state)
        groups = state.get("group_ranks")
        if self.server is None and self._probing and groups is not None:
            rank = self.workers_comm.rank
            me = self.workers[rank]
            index = next(k for k, ranks in enumerate(groups) if me in ranks)
            self.group_ranks = [list(ranks) for ranks in groups]
            self.group = self.workers_comm.split(index)
            self._probing = False

    def policy(self) -> GroupStaleness:
        """MXNet-G's staleness weight."""
        return GroupStaleness()
