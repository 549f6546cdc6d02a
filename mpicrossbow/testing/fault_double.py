"""An in-process fault double for elastic training: ranks as threads whose deaths are injected on demand
(torchft's ``FakeProcessGroupWrapper``), so recovery is tested without ``mpiexec --with-ft ulfm``.

``FaultyWorld(4).run(fn)`` runs ``fn(group)`` on four threads, each given a :class:`FaultyGroup` — a
:class:`~mpicrossbow.comm.elastic.FaultTolerantGroup` as :class:`~mpicrossbow.comm.elastic.MPIGroup` is one
under ULFM — and returns the results in rank order (None for a rank that died). A rank dies by calling
:meth:`FaultyWorld.die` (it never returns: the thread ends, as a SIGKILLed process does). What the others
then see follows ULFM's contract:

* a collective or receive (non-blocking: tested or waited for) that needs the dead rank, or runs on a
  revoked group, raises
  :class:`~mpicrossbow.comm.ulfm.PeerLost` — on the ranks still waiting for it; one whose every
  contribution arrived before the death completes there (ULFM's collectives are not uniform either: the
  same operation may complete on some ranks and fail on others);
* :meth:`FaultyGroup.revoke` wakes every member blocked in the group with PeerLost;
* :meth:`FaultyGroup.agree` is uniform: every live member gets the same answer, False when a member of
  the group is dead or any flag is False; :meth:`FaultyGroup.shrink` gives every live member the same new
  group of the live members, in their old order. Both work on a revoked group.

Collectives reduce in rank order (as :mod:`.inprocess` does), so the survivors' results are bitwise
identical. Every wait is bounded by the world's timeout (TimeoutError), so a broken recovery fails a test
instead of hanging it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..comm.base import Communicator, DoneHandle, Handle, ReduceOp
from ..comm.elastic import FaultTolerantGroup
from ..comm.ulfm import PeerLost

T = TypeVar("T")

_REDUCE = {ReduceOp.SUM: torch.add, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}


class _Death(BaseException):
    """Unwinds a rank's thread when it dies (BaseException: no ``except Exception`` of the code under test
    can swallow it)."""


class _GroupState:
    """One group's members (world ranks, in group-rank order), revocation and meeting places."""

    ids = itertools.count()

    def __init__(self, members: tuple[int, ...]) -> None:
        self.id, self.members, self.revoked = next(self.ids), members, False
        #: (kind, n) -> {member: value}: the n-th operation of a kind each member started.
        self.deposits: defaultdict[tuple[str, int], dict[int, Any]] = defaultdict(dict)
        #: (kind, n) -> the uniform outcome of the n-th agreement or shrink.
        self.decisions: dict[tuple[str, int], Any] = {}
        #: (src, dst, tag) -> messages not yet received.
        self.mail: defaultdict[tuple[int, int, int], list[torch.Tensor]] = defaultdict(list)
        self.counts: defaultdict[tuple[int, str], int] = defaultdict(int)


class FaultyWorld:
    """``size`` ranks as threads with injectable deaths; :meth:`run` gives each a :class:`FaultyGroup`."""

    def __init__(self, size: int, timeout_s: float = 30.0) -> None:
        if size < 1:
            raise ValueError(f"world size must be at least 1, got {size}")
        self.size, self.timeout_s = size, timeout_s
        self.cond = threading.Condition()
        self.dead: set[int] = set()

    def die(self, rank: int) -> None:
        """Rank ``rank`` (the caller's own) dies now: every waiter is woken, and this thread ends."""
        with self.cond:
            self.dead.add(rank)
            self.cond.notify_all()
        raise _Death

    def wait_for(self, ready: Callable[[], bool], failed: Callable[[], bool], what: str) -> None:
        """Block (the condition held) until ``ready()``; PeerLost once ``failed()`` while not ready;
        TimeoutError after the world's timeout."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if failed():
                raise PeerLost(f"{what}: a rank was lost (fault double)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} timed out after {self.timeout_s}s (fault double)")
            self.cond.wait(remaining)

    def run(self, fn: Callable[[FaultyGroup], T]) -> list[T | None]:
        """Run ``fn(group)`` on every rank; the results in rank order, None for the ranks that died; the
        first error of a live rank is raised, its rank named in a note."""
        root = _GroupState(tuple(range(self.size)))
        results: list[T | None] = [None] * self.size
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(FaultyGroup(self, root, rank))
            except _Death:
                pass
            except BaseException as exc:
                errors.append((rank, exc))
                with self.cond:  # a rank that fails dies as far as the others can tell
                    self.dead.add(rank)
                    self.cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.timeout_s * 4)
            if thread.is_alive():
                raise TimeoutError(f"fault double: a rank still runs {self.timeout_s * 4}s on")
        if errors:
            rank, exc = errors[0]
            exc.add_note(f"raised on fault-double rank {rank} of {self.size}")
            raise exc
        return results


class FaultyGroup(FaultTolerantGroup):
    """One member's view of a group of a :class:`FaultyWorld`."""

    def __init__(self, world: FaultyWorld, state: _GroupState, me: int) -> None:
        self.world, self.state, self.me = world, state, me
        self._comm: FaultyCommunicator | None = None

    def communicator(self) -> FaultyCommunicator:
        """The group's communicator (one per member view)."""
        if self._comm is None:
            self._comm = FaultyCommunicator(self)
        return self._comm

    def start_ranks(self) -> tuple[int, ...]:
        """The members' world ranks, in group-rank order."""
        return self.state.members

    def indices_in(self, before: FaultTolerantGroup) -> tuple[int, ...]:
        """Each member's place in ``before``'s members."""
        assert isinstance(before, FaultyGroup)
        return tuple(before.state.members.index(m) for m in self.state.members)

    def revoke(self) -> None:
        """Every member's pending and future operation on the group raises PeerLost."""
        with self.world.cond:
            self.state.revoked = True
            self.world.cond.notify_all()

    def _decide(self, kind: str, value: Any, decide: Callable[[dict[int, Any], set[int]], Any]) -> Any:
        """The uniform outcome of this member's next ``kind``: decided once, by the first member that finds
        every live member's ``value`` in, from the values and the dead members at that moment."""
        state, world = self.state, self.world
        with world.cond:
            n = state.counts[(self.me, kind)]
            state.counts[(self.me, kind)] += 1
            key = (kind, n)
            state.deposits[key][self.me] = value
            world.cond.notify_all()

            def ready() -> bool:
                if key in state.decisions:
                    return True
                live = [m for m in state.members if m not in world.dead]
                if all(m in state.deposits[key] for m in live):
                    dead = {m for m in state.members if m in world.dead}
                    state.decisions[key] = decide(state.deposits[key], dead)
                    return True
                return False

            world.wait_for(ready, lambda: False, f"{kind} on fault-double group {state.id}")
            return state.decisions[key]

    def agree(self, flag: bool) -> bool:
        """AND of the live members' flags, False when a member is dead; the same on every live member."""
        return bool(self._decide("agree", flag, lambda flags, dead: not dead and all(flags.values())))

    def shrink(self) -> FaultyGroup:
        """The live members, in their old order, as a new group: the same one for every live member."""
        members = self.state.members

        def decide(_: dict[int, Any], dead: set[int]) -> _GroupState:
            return _GroupState(tuple(m for m in members if m not in dead))

        return FaultyGroup(self.world, self._decide("shrink", None, decide), self.me)

    def split(self, color: int, key: int | None = None) -> FaultyGroup:
        """The members of ``color`` as a new group (:meth:`FaultyCommunicator.split`)."""
        return self.communicator().split(color, key).group


class FaultyCommunicator(Communicator):
    """A member's communicator over a :class:`FaultyGroup`; every operation completes before it returns."""

    name = "faulty"

    def __init__(self, group: FaultyGroup) -> None:
        self.group = group
        self._splits = 0

    @property
    def rank(self) -> int:
        """This member's rank in the group."""
        return self.group.state.members.index(self.group.me)

    @property
    def size(self) -> int:
        """The group's members."""
        return len(self.group.state.members)

    def _failed(self) -> bool:
        state, dead = self.group.state, self.group.world.dead
        return state.revoked or any(m in dead for m in state.members)

    def _exchange(self, kind: str, value: Any) -> list[Any]:
        """Every member's ``value`` of this member's next ``kind``, in group-rank order; PeerLost when a
        member dies before its value is in, or the group is revoked."""
        group, world = self.group, self.group.world
        state = group.state
        with world.cond:
            if state.revoked:
                raise PeerLost(f"{kind} on a revoked fault-double group {state.id}")
            n = state.counts[(group.me, kind)]
            state.counts[(group.me, kind)] += 1
            key = (kind, n)
            state.deposits[key][group.me] = value
            world.cond.notify_all()
            box = state.deposits[key]
            world.wait_for(lambda: len(box) == len(state.members), self._failed, kind)
            return [box[m] for m in state.members]

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """Reduce in rank order into every member's tensor."""
        values = self._exchange("allreduce", tensor.detach().clone())
        acc = values[0]
        for value in values[1:]:
            acc = _REDUCE[op](acc, value)
        tensor.detach().copy_(acc)
        return DoneHandle()

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """``root``'s tensor into every member's."""
        values = self._exchange("broadcast", tensor.detach().clone() if self.rank == root else None)
        tensor.detach().copy_(values[root])
        return DoneHandle()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Buffered: a copy goes into the (self, dst, tag) channel now."""
        state, world = self.group.state, self.group.world
        with world.cond:
            if state.revoked:
                raise PeerLost(f"isend on a revoked fault-double group {state.id}")
            state.mail[(self.rank, dst, tag)].append(tensor.detach().clone())
            world.cond.notify_all()
        return DoneHandle()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """A pending receive of the next message of the (src, self, tag) channel (non-blocking, as MPI's:
        a server keeps one posted per worker and tests them all)."""
        return _PendingRecv(self.group, tensor, src, self.rank, tag)

    def barrier(self) -> None:
        """Every member is here."""
        self._exchange("barrier", None)

    def split(self, color: int, key: int | None = None) -> FaultyCommunicator:
        """Sub-groups by ``color``, ordered by ``key`` then rank, as ``MPI_Comm_split``: the members of one
        colour share one new group."""
        values = self._exchange("split", (color, self.rank if key is None else key))
        members = tuple(
            self.group.state.members[r]
            for _, r in sorted((k, r) for r, (c, k) in enumerate(values) if c == color)
        )
        state = self.group.state
        with self.group.world.cond:  # the first member here makes the sub-group
            made = state.decisions.setdefault(("split", self._splits, color), _GroupState(members))
        self._splits += 1
        return FaultyGroup(self.group.world, made, self.group.me).communicator()

    def split_node(self) -> FaultyCommunicator:
        """One node: every member."""
        return self.split(0)


class _PendingRecv(Handle):
    """A receive of the fault double: complete once its channel holds a message (taken at a test or the
    wait); PeerLost when the sender is dead or the group revoked before one arrived."""

    def __init__(self, group: FaultyGroup, tensor: torch.Tensor, src: int, dst: int, tag: int) -> None:
        self._group, self._tensor, self._src = group, tensor, src
        self._box = group.state.mail[(src, dst, tag)]
        self._done = False

    def _take(self) -> bool:
        """Under the world's condition: complete when a message is there (it is taken)."""
        if not self._done and self._box:
            self._tensor.detach().copy_(self._box.pop(0))
            self._done = True
        return self._done

    def _failed(self) -> bool:
        state = self._group.state
        return state.revoked or state.members[self._src] in self._group.world.dead

    def test(self) -> bool:
        """Whether the message arrived; PeerLost when it cannot any more."""
        with self._group.world.cond:
            if self._take():
                return True
            if self._failed():
                raise PeerLost("irecv: a rank was lost (fault double)")
            return False

    def wait(self) -> None:
        """Until the message arrived; PeerLost when it cannot (bounded by the world's timeout)."""
        with self._group.world.cond:
            self._group.world.wait_for(self._take, self._failed, "irecv")
