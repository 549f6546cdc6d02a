"""The elastic communicator: the one place a lost rank is noticed and recovered from (``[elastic] enabled``).

Rules keep talking to a :class:`~mpicrossbow.comm.base.Communicator`; in elastic training it is an
:class:`ElasticCommunicator`, which forwards every operation to the communicator over the current members
and swaps that communicator underneath when a rank is lost — as torchft keeps its rules unaware of
reconfiguration by swapping the process group under its Manager. It does three things:

* **notice**: an operation (or the wait of its handle) that meets a process failure — ULFM's
  ERR_PROC_FAILED, ERR_PROC_FAILED_PENDING or ERR_REVOKED — revokes the communicator, so every other member
  blocked anywhere in it is released with ERR_REVOKED, and raises :class:`~mpicrossbow.comm.ulfm.PeerLost`;
  in an asynchronous run (``isolate_peers``) a point-to-point operation raises it without revoking, so a
  parameter server forgets the lost worker and serves the others on;
* **commit**: :meth:`ElasticCommunicator.commit` is the fault-tolerant agreement (``MPI_Comm_agree``) that a
  piece of collective work completed on every member; all survivors get the same answer, also when a rank
  died during the agreement itself (torchft's ``should_commit``);
* **recover**: :meth:`ElasticCommunicator.recover` shrinks to the survivors, builds the communicator the run
  uses over them (the same factory as at start: compression, splits made afresh), and moves the
  :class:`~mpicrossbow.comm.membership.Membership` one version on.

Commit and recover make the one retry primitive, :func:`until_committed`: run collective work, commit it,
redo it over the survivors after a loss. Elastic training does that in three places — the run's committed
collectives (:class:`~mpicrossbow.training.elastic.fault_tolerance.FaultTolerance`), GSP's group steps
(:mod:`mpicrossbow.rules.gsp`) and an asynchronous run's snapshot meeting
(:mod:`mpicrossbow.training.elastic.elastic_pause`) — and each calls it:

1. every member runs the work; a member whose work met a lost rank (an exception ``is_failure`` accepts)
   says no;
2. the members **commit**: a member that says no revokes the group first (so no member stays blocked in the
   work), then all agree fault-tolerantly (``MPI_Comm_agree``) on the AND of their answers — the same answer
   on every survivor;
3. yes: the work counts and its value is returned; no: every survivor calls ``recover`` (shrink to the live
   members and whatever the caller moves on with them), and the work runs again over the survivors, told
   that it is a redo.

So a piece of collective work is applied on every survivor or on none, never on some.

What to do with the work that was not committed, and what a rule must rebuild (its splits, its peers), is
the training loop's business (:mod:`mpicrossbow.training.elastic.fault_tolerance`) and the rule's
(``on_rebind``). The fault-tolerant substrate is a :class:`FaultTolerantGroup`: :class:`MPIGroup` over mpi4py
with ULFM, and :class:`~mpicrossbow.testing.fault_double.FaultyGroup`, ranks as threads with deaths injected
on demand (torchft's FakeProcessGroupWrapper), which tests recovery in-process.
"""

from __future__ import annotations

import dataclasses
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..config import CommSection
from .base import Communicator, Handle, ReduceOp
from .membership import Membership
from .ulfm import PeerLost, is_process_failure

R = TypeVar("R")
T = TypeVar("T")


def lost_peer(exc: BaseException) -> bool:
    """The default ``is_failure`` of :func:`until_committed`: a :class:`~.ulfm.PeerLost` from the elastic
    communicator."""
    return isinstance(exc, PeerLost)


def until_committed(
    work: Callable[[bool], T],
    commit: Callable[[bool], bool],
    recover: Callable[[float], None],
    is_failure: Callable[[BaseException], bool] = lost_peer,
    clock: Callable[[], float] | None = None,
) -> T:
    """``work(redo)`` until every member committed it (the retry primitive of the module doc); its value on
    that attempt.

    ``commit(ok)`` revokes where not ``ok`` and agrees (:meth:`ElasticCommunicator.commit`);
    ``recover(started)`` moves the survivors on after a failed commit, ``started`` being when the failed
    attempt began (``clock()``, for the recovery's timing); exceptions ``is_failure`` does not accept
    propagate untouched.
    """
    redo = False
    while True:
        started = clock() if clock is not None else 0.0
        ok, value = True, None
        try:
            value = work(redo)
        except Exception as exc:
            if not is_failure(exc):
                raise
            ok = False
        if commit(ok):
            return value  # type: ignore[return-value]
        recover(started)
        redo = True


class FaultTolerantGroup(ABC):
    """A group of processes that can be revoked, shrunk to its live members and agree despite failures."""

    @abstractmethod
    def communicator(self) -> Communicator:
        """The communicator the run uses over this group (built on first call, then the same object)."""

    @abstractmethod
    def start_ranks(self) -> tuple[int, ...]:
        """The members' ranks at start, in rank order (local: no communication)."""

    @abstractmethod
    def indices_in(self, before: FaultTolerantGroup) -> tuple[int, ...]:
        """Each member's rank in ``before`` (a group this one was shrunk from), in this group's rank order
        (local: no communication). A shrunk group's members are found this way, not by their start ranks:
        a replacement (``[elastic] replace``) was never part of the start world."""

    @abstractmethod
    def revoke(self) -> None:
        """Make every pending and future operation of the group fail on every member (idempotent)."""

    @abstractmethod
    def shrink(self) -> FaultTolerantGroup:
        """The group of the live members (collective over them; works on a revoked group)."""

    @abstractmethod
    def agree(self, flag: bool) -> bool:
        """AND of every live member's ``flag``; False on every member when a member failed (collective,
        fault-tolerant, the same answer everywhere)."""

    @abstractmethod
    def split(self, color: int, key: int | None = None) -> FaultTolerantGroup:
        """The members of ``color`` as a group of their own, ordered by ``key`` then rank (collective over
        every member, as ``MPI_Comm_split``): it is revoked, shrunk and agrees without the others — GSP's
        worker groups recover inside themselves while the rest of the job goes on."""

    @property
    def native(self) -> Any:
        """The library's own handle of the group (an mpi4py communicator), for code that needs it; None
        where there is none (the in-process fault double: one process, one node, no MPI)."""
        return None

    def is_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` says a member was lost (or the group revoked because of it)."""
        return isinstance(exc, PeerLost) or is_process_failure(exc)


class MPIGroup(FaultTolerantGroup):
    """An mpi4py communicator under ULFM; ``build`` makes the run's communicator over it."""

    def __init__(self, comm: Any, build: Callable[[Any], Communicator]) -> None:
        from mpi4py import MPI

        comm.Set_errhandler(MPI.ERRORS_RETURN)  # errors become exceptions, never an abort of the job
        self._comm, self._build = comm, build
        self._built: Communicator | None = None

    @property
    def native(self) -> Any:
        """The mpi4py communicator."""
        return self._comm

    def communicator(self) -> Communicator:
        """``build(comm)``, made once."""
        if self._built is None:
            self._built = self._build(self._comm)
        return self._built

    def start_ranks(self) -> tuple[int, ...]:
        """The members' ``COMM_WORLD`` ranks (a group translation: local)."""
        from mpi4py import MPI

        group, world = self._comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            return tuple(int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.size)), world))
        finally:
            group.Free()
            world.Free()

    def indices_in(self, before: FaultTolerantGroup) -> tuple[int, ...]:
        """A group translation from this communicator's group into ``before``'s (local)."""
        from mpi4py import MPI

        mine, theirs = self._comm.Get_group(), before.native.Get_group()
        try:
            return tuple(int(r) for r in MPI.Group.Translate_ranks(mine, list(range(mine.size)), theirs))
        finally:
            mine.Free()
            theirs.Free()

    def merged(self, comm: Any) -> MPIGroup:
        """The group over ``comm`` (this group's members and processes merged with it, e.g. replacements),
        whose run's communicator is built as this group's."""
        return MPIGroup(comm, self._build)

    def is_failure(self, exc: BaseException) -> bool:
        """Also any MPI error once the communicator is revoked: Open MPI's libnbc aborts a non-blocking
        collective's schedule when another member revokes, and its request completes with MPI_ERR_OTHER
        (seen with SMA's allreduce on a rank slower than the others when a rank died in that exchange)."""
        if super().is_failure(exc):
            return True
        from mpi4py import MPI

        if not isinstance(exc, MPI.Exception):
            return False
        try:
            return bool(self._comm.Is_revoked())
        except MPI.Exception:
            return False

    def revoke(self) -> None:
        """``MPI_Comm_revoke`` (a second revoke, or one of a broken communicator, is harmless)."""
        from mpi4py import MPI

        try:
            self._comm.Revoke()
        except MPI.Exception:
            pass

    def shrink(self) -> MPIGroup:
        """``MPI_Comm_shrink``: the survivors, in their old order."""
        return MPIGroup(self._comm.Shrink(), self._build)

    def split(self, color: int, key: int | None = None) -> MPIGroup:
        """``MPI_Comm_split`` (the same ``build`` over the new communicator)."""
        return MPIGroup(self._comm.Split(color, self._comm.Get_rank() if key is None else key), self._build)

    def agree(self, flag: bool) -> bool:
        """``MPI_Comm_agree`` on ``flag``; a failure it reports (uniformly) is a False."""
        from mpi4py import MPI

        try:
            return bool(self._comm.Agree(int(flag)) & 1)
        except MPI.Exception as exc:
            if not is_process_failure(exc):
                raise
            return False


class GuardedCommunicator(Communicator):
    """Forwards to ``target()``; an operation that meets a lost rank revokes ``group()`` and raises
    :class:`PeerLost` instead of the library's error."""

    def __init__(self, target: Callable[[], Communicator], group: Callable[[], FaultTolerantGroup]) -> None:
        self._target, self._group = target, group
        #: Asynchronous rules: a point-to-point operation that meets its peer's loss raises PeerLost without
        #: revoking the group, so the rank can forget that peer and go on with the others (a parameter
        #: server's receives from its live workers stay posted); collectives revoke as always.
        self.isolate_peers = False

    @property
    def name(self) -> str:  # type: ignore[override]
        """``elastic+`` and the inner communicator's name."""
        return f"elastic+{self._target().name}"

    def _call(
        self, fn: Callable[[], R], group: FaultTolerantGroup | None = None, isolated: bool = False
    ) -> R:
        """``fn()``, its lost-rank failure turned into a revoke (of ``group``, default the current one: a
        handle revokes the group it was started in; none when ``isolated``) and :class:`PeerLost`."""
        try:
            return fn()
        except Exception as exc:
            group = self._group() if group is None else group
            if not group.is_failure(exc):
                raise
            if not isolated:
                group.revoke()
            if isinstance(exc, PeerLost):
                raise
            raise PeerLost(f"a rank was lost ({exc})") from exc

    def _handle(self, fn: Callable[[], Handle], peer: bool = False) -> Handle:
        group, isolated = self._group(), peer and self.isolate_peers
        return _GuardedHandle(self._call(fn, group, isolated), self, group, isolated)

    @property
    def rank(self) -> int:
        """The rank among the current members."""
        return self._target().rank

    @property
    def size(self) -> int:
        """The current members."""
        return self._target().size

    @property
    def overlaps(self) -> bool:
        """As the inner communicator."""
        return self._target().overlaps

    @property
    def exact(self) -> Communicator:
        """The inner communicator without compression, guarded the same way (a point-to-point loss isolated
        as here: an asynchronous run's exact messages, e.g. a parameter server's mirror, revoke nothing)."""
        exact = GuardedCommunicator(lambda: self._target().exact, self._group)
        exact.isolate_peers = self.isolate_peers
        return exact

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """The inner allreduce."""
        return self._handle(lambda: self._target().allreduce(tensor, op, async_op))

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """The inner broadcast."""
        return self._handle(lambda: self._target().broadcast(tensor, root, async_op))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """The inner isend."""
        return self._handle(lambda: self._target().isend(tensor, dst, tag), peer=True)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """The inner irecv."""
        return self._handle(lambda: self._target().irecv(tensor, src, tag), peer=True)

    def barrier(self) -> None:
        """The inner barrier."""
        self._call(lambda: self._target().barrier())

    def split(self, color: int, key: int | None = None) -> Communicator:
        """The inner split, guarded; it spans the members of now (a rule remakes it in ``on_rebind``)."""
        inner = self._call(lambda: self._target().split(color, key))
        return GuardedCommunicator(lambda: inner, self._group)

    def split_node(self) -> Communicator:
        """The inner node split, guarded; remade by the rule in ``on_rebind`` as :meth:`split`."""
        inner = self._call(lambda: self._target().split_node())
        return GuardedCommunicator(lambda: inner, self._group)

    def share(self, tensor: torch.Tensor) -> None:
        """The inner share (collective over the node)."""
        self._call(lambda: self._target().share(tensor))

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """The inner mean (its divisor is the caller's, from the current size)."""
        self._call(lambda: self._target().allreduce_mean(tensor, count))

    def allreduce_scalars(self, values: list[float], op: ReduceOp = ReduceOp.SUM) -> list[float]:
        """The inner scalar allreduce."""
        return self._call(lambda: self._target().allreduce_scalars(values, op))


class _GuardedHandle(Handle):
    """A pending operation whose wait or test may meet a lost rank: :class:`PeerLost` then."""

    def __init__(
        self, inner: Handle, comm: GuardedCommunicator, group: FaultTolerantGroup, isolated: bool = False
    ) -> None:
        self._inner, self._comm, self._group, self._isolated = inner, comm, group, isolated

    def wait(self) -> None:
        """The inner wait, guarded."""
        self._comm._call(self._inner.wait, self._group, self._isolated)

    def test(self) -> bool:
        """The inner test, guarded."""
        return self._comm._call(self._inner.test, self._group, self._isolated)


class ElasticCommunicator(GuardedCommunicator):
    """The run's communicator in elastic training: the current members' communicator, swapped on recovery."""

    def __init__(self, group: FaultTolerantGroup, membership: Membership | None = None) -> None:
        super().__init__(lambda: self._inner, lambda: self._group_now)
        self._group_now = group
        self._inner = group.communicator()
        #: Who the members are: the start world (version 0), or ``membership`` (a replacement joining).
        self.membership = membership or Membership(0, group.start_ranks(), self._inner.rank)

    @property
    def group(self) -> FaultTolerantGroup:
        """The fault-tolerant group of the current members."""
        return self._group_now

    def share(self, tensor: torch.Tensor) -> None:
        """The inner share while the members are the start world (membership version 0), else nothing.

        A share is collective over the node, and after a membership change the members no longer call it
        alike: a replacement binds its rule (which shares its buffers) while the survivors do not. Buffers
        that stay private take the copying path of node-shared memory: the same sums, bit for bit."""
        if self.membership.version == 0:
            super().share(tensor)

    def split_apart(self, color: int, key: int | None = None) -> ElasticCommunicator:
        """The members of ``color`` as an elastic communicator over a fault-tolerant group of their own
        (:meth:`FaultTolerantGroup.split`): a loss inside it revokes it alone, and its members commit and
        recover without the others (GSP's worker groups)."""
        return ElasticCommunicator(self._group_now.split(color, key))

    def commit(self, ok: bool) -> bool:
        """Whether the work since the last commit completed on every member: ``ok`` from each (False where
        it met a lost rank; that member revokes first, so none stays blocked), agreed fault-tolerantly."""
        if not ok:
            self._group_now.revoke()
        return self._group_now.agree(ok)

    def recover(self) -> Membership:
        """Revoke, shrink to the survivors, rebuild the run's communicator over them; the new membership.
        Collective over the survivors. The old communicator is dropped, not freed: freeing is collective
        and would wait on the dead."""
        before = self._group_now
        before.revoke()
        self._group_now = before.shrink()
        self._inner = self._group_now.communicator()
        kept = self._group_now.indices_in(before)
        ranks = tuple(self.membership.ranks[i] for i in kept)
        hosts = tuple(self.membership.hosts[i] for i in kept) if self.membership.hosts else ()
        self.membership = Membership(self.membership.version + 1, ranks, self._inner.rank, hosts)
        return self.membership

    def grow(self, group: FaultTolerantGroup, ranks: tuple[int, ...], hosts: tuple[str, ...]) -> Membership:
        """Replacements joined: ``group`` spans the members and them (members first, in their order), and
        ``ranks`` are the start ranks each member stands for (``hosts``: where each runs); the run's
        communicator is rebuilt over it and the membership moves one version on. Collective over
        ``group``."""
        self._group_now = group
        self._inner = group.communicator()
        self.membership = Membership(self.membership.version + 1, ranks, self._inner.rank, hosts)
        return self.membership

    def close(self) -> None:
        """Close the current members' communicator."""
        self._inner.close()

    def __repr__(self) -> str:
        return f"ElasticCommunicator({self._inner!r}, {self.membership})"


def elastic_over_mpi(
    section: CommSection,
    device: torch.device | str,
    mpi_comm: Any,
    isolate_peers: bool = False,
    membership: Membership | None = None,
) -> ElasticCommunicator:
    """The run's communicator for elastic training over ``mpi_comm`` (a duplicate is taken): what
    :func:`~mpicrossbow.comm.make_communicator` builds from ``section``, its node-shared memory's waits
    noticing a lost rank (``notice_failures``), rebuilt the same way over the survivors after a loss. A
    replacement joining (``membership`` given) takes the merged ``mpi_comm`` as it is, as the survivors
    take it (:meth:`MPIGroup.merged`). ``isolate_peers``: an asynchronous run's (a parameter server forgets
    a lost worker, :attr:`GuardedCommunicator.isolate_peers`)."""
    from . import make_communicator

    comm = mpi_comm if membership else mpi_comm.Dup()
    group = MPIGroup(comm, lambda c: make_communicator(section, device, c, notice_failures=True))
    elastic = ElasticCommunicator(group, membership)
    elastic.isolate_peers = isolate_peers
    if membership is None:  # at start, collective: where each rank runs, for its replacement
        hosts = tuple(comm.allgather(socket.gethostname()))
        elastic.membership = dataclasses.replace(elastic.membership, hosts=hosts)
    return elastic
