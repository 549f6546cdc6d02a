"""A replica group's communicator joined to the other groups': the rules' exchanges over every rank of every
live group, as one communicator, with the loss of a whole group (its node, its MPI job) survived.

Each group is its own MPI job (``[link] groups``; a node each, so a lost node costs its group only, see
:mod:`.group_link`); ``inner`` is its communicator. Who sends what to whom in an allreduce:

1. the group's ranks reduce over ``inner`` (shared memory, MPI, NCCL: the fast path within a node);
2. the group's rank 0, its leader, sums that with the other leaders over the link
   (:class:`~.group_link.GroupLink`: Gloo; after a group's loss the survivors form a new quorum and sum
   again from their own inputs);
3. the leader broadcasts the result over ``inner``, with the live groups (two int64 numbers), so every rank
   of the group knows the world's size at once.

``allreduce_mean`` sums the contributions' count with the tensor, so a mean after a loss is over the learners
that are left, whatever count the rule passed for the world it knew. A broadcast is a sum in which only the
root's group gives its tensor.

A group back after its loss (its job restarted, on the same node or a spare) starts **joining**: its
operations stay within the group (the rule's binding at start) until it took a peer's state
(:meth:`LinkedCommunicator.take_state`, which its leader receives over the link). The members learn at a sum
that it waits (:attr:`LinkedCommunicator.pending`, carried with the live groups, so every rank knows) and let
it in where their state is whole, at the start of a step (:meth:`LinkedCommunicator.admit_pending`, the
source group's leader handing the state over): :mod:`mpicrossbow.training.returning_group`.

Ranks are numbered group by group (group ``g``'s rank ``r`` is ``offset(g) + r``), every group the same size.
Point-to-point messages and splits do not cross groups (they are refused at once, NotImplementedError): rules
that need them are refused before training (:func:`~mpicrossbow.training.replica_groups.check_linked`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import Communicator, DoneHandle, Handle, ReduceOp
from .group_link import GroupLink

#: The operations the link carries, by :class:`~.base.ReduceOp`.
_LINK_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}


class LinkedCommunicator(Communicator):
    """``inner`` (this group's ranks) joined through ``link`` (held by the group's rank 0, None on the others)
    to the other groups of ``groups``, each of ``inner.size`` ranks; this rank's group is ``group``.
    Collective over the group: its leader tells the others the live groups, and whether the group is
    joining a run under way."""

    name = "linked"

    def __init__(self, inner: Communicator, link: GroupLink | None, group: int, groups: int) -> None:
        if (link is not None) != (inner.rank == 0):
            raise ValueError("the link belongs to the group's rank 0, and only to it")
        if groups > 62:
            raise ValueError(f"[link] groups = {groups}: at most 62 (the live groups travel as one int64)")
        self.inner, self.link, self.group = inner, link, group
        #: Groups back from a loss and admitted at a sum, waiting for :meth:`admit_pending`.
        self.pending: tuple[int, ...] = ()
        #: The era, the live groups and the pending ones (bit masks), as the leader tells its group.
        self._live = torch.zeros(3, dtype=torch.int64)
        start = torch.zeros(2, dtype=torch.int64)
        if link is not None:
            start[0], start[1] = int(group in link.quorum.joined), _mask(link.quorum.groups)
        inner.broadcast(start, 0).wait()
        #: This group came back to a run under way: its operations stay within it until :meth:`take_state`.
        self.joining = bool(start[0])
        #: The live groups, in order (all of them until a loss; the link's quorum for a group back).
        self.groups: tuple[int, ...] = _groups(int(start[1])) if start[1] else tuple(range(groups))

    @property
    def rank(self) -> int:
        """Group by group: the live groups before this one, times the group size, plus the rank in it."""
        return self.groups.index(self.group) * self.inner.size + self.inner.rank

    @property
    def size(self) -> int:
        """Every rank of every live group."""
        return len(self.groups) * self.inner.size

    @property
    def overlaps(self) -> bool:
        """No: an operation completes before it returns (a handle returned is done)."""
        return False

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """Reduce within the group, across the live groups' leaders, back to the group (blocking)."""
        self.inner.allreduce(tensor, op).wait()
        if not self.joining:
            self._across(tensor, op)
        return DoneHandle()

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """The mean over the contributions of the live groups: ``count`` is this world's (ranks × learners),
        this group's share of it summed across the groups with the tensor."""
        self.inner.allreduce(tensor).wait()
        share = count * self.inner.size / self.size
        if self.joining:  # within the group
            tensor.div_(share)
            return
        flat = tensor.reshape(-1)
        both = torch.cat([flat.to(torch.float64, copy=True), flat.new_tensor([share], dtype=torch.float64)])
        self._across(both, ReduceOp.SUM)
        flat.copy_(both[:-1].div_(both[-1]).to(flat.dtype))

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """Rank ``root``'s tensor on every rank: within its group first, then a sum across the leaders to
        which only its group gives a non-zero tensor."""
        size = self.inner.size
        if self.joining:  # within the group: its own first rank
            return self.inner.broadcast(tensor, 0)
        root_group = self.groups[root // size]
        if root_group == self.group:
            self.inner.broadcast(tensor, root % size).wait()
        elif self.inner.rank == 0:
            tensor.zero_()
        self._across(tensor, ReduceOp.SUM)
        return DoneHandle()

    def barrier(self) -> None:
        """Every rank of every live group has reached it."""
        self.allreduce(torch.zeros(1))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Not across groups: the rules that send point to point are refused before training."""
        raise NotImplementedError("a point-to-point message cannot cross replica groups ([link] groups)")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """Not across groups (see :meth:`isend`)."""
        raise NotImplementedError("a point-to-point message cannot cross replica groups ([link] groups)")

    def split(self, color: int, key: int | None = None) -> Communicator:
        """Not across groups: the rules that split are refused before training."""
        raise NotImplementedError("a communicator cannot be split across replica groups ([link] groups)")

    def split_node(self) -> Communicator:
        """This node's ranks: within the group (a group is a node or nodes)."""
        return self.inner.split_node()

    def share(self, tensor: torch.Tensor) -> None:
        """As the group's communicator."""
        self.inner.share(tensor)

    def close(self) -> None:
        """Leave the link (the leader; group 0's waits for the others), close the group's communicator."""
        if self.link is not None:
            self.link.close()
        self.inner.close()

    def admit_pending(self, state: Callable[[], bytes]) -> tuple[int, ...]:
        """Where every member's state is whole (the start of a step; collective over every rank of the
        quorum's groups, :attr:`pending` the same on each): the pending groups join, the source group's
        leader handing over ``state()`` (the lowest group's: only there is it called). The groups that joined
        (none when they were gone again before the new era formed)."""
        before = self.groups
        if self.link is not None:
            payload = state() if self.group == min(before) else None
            quorum = self.link.admit_pending()
            if quorum.joined:
                self.link.share_state(payload if self.group == quorum.source else None)
            self._live[0], self._live[1], self._live[2] = quorum.era, _mask(quorum.groups), 0
        self.inner.broadcast(self._live, 0).wait()
        self._take_live()
        return tuple(g for g in self.groups if g not in before)

    def take_state(self) -> bytes | None:
        """A joining group (collective over it, and over the link with the members' :meth:`admit_pending`):
        the state its source handed over, on the leader (None on the others); its operations cross the
        groups from here."""
        data = self.link.share_state(None) if self.link is not None else None
        self.joining = False
        return data

    def _take_live(self) -> None:
        """The live and pending groups from :attr:`_live`, as the leader broadcast it."""
        mask = int(self._live[1])
        if mask:
            self.groups = _groups(mask)
        self.pending = _groups(int(self._live[2]))

    def _across(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """The leader reduces ``tensor`` (this group's result) across the live groups; the group receives
        the result and the live groups."""
        if self.link is not None:
            staged = tensor if tensor.device.type == "cpu" else tensor.cpu()
            quorum = self.link.allreduce(staged, _LINK_OPS[op])
            if staged is not tensor:
                tensor.copy_(staged)
            self._live[0], self._live[1] = quorum.era, _mask(quorum.groups)
            self._live[2] = _mask(self.link.pending)
        self.inner.broadcast(tensor, 0).wait()
        self.inner.broadcast(self._live, 0).wait()
        self._take_live()


def _mask(groups: tuple[int, ...]) -> int:
    """``groups`` as one int64: bit ``g`` set for group ``g``."""
    return sum(1 << g for g in groups)


def _groups(mask: int) -> tuple[int, ...]:
    """The groups of a :func:`_mask`, in order."""
    return tuple(g for g in range(63) if mask >> g & 1)
