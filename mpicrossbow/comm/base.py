"""The Communicator interface every exchange rule talks to.

A rule never sees MPI, Gloo or NCCL directly: it sees a :class:`Communicator` with a rank, a size and a few
operations on *flat tensors* (allreduce, broadcast, isend/irecv, barrier, split). Every operation returns a
:class:`Handle`; blocking calls return one that is already complete, so callers can treat both alike.

Implementations: :mod:`mpicrossbow.comm.mpi` (mpi4py), :mod:`mpicrossbow.comm.torchdist` (torch.distributed,
Gloo or NCCL, bootstrapped from MPI) and :mod:`mpicrossbow.testing.inprocess` (a world of threads for tests).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

import torch


class ReduceOp(enum.Enum):
    """Reduction applied by :meth:`Communicator.allreduce`."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


class Handle(ABC):
    """A pending (or finished) communication; ``wait()`` blocks until the tensors involved may be reused."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation is complete."""

    @abstractmethod
    def test(self) -> bool:
        """Return True when the operation is complete, without blocking."""


class FollowUpHandle(Handle):
    """A pending operation plus what must run exactly once when it is first seen complete (copy a result
    back from a staging buffer, widen 16-bit values, release buffers). Subclasses say how to wait for and
    test the operation itself."""

    def __init__(self, finish: Callable[[], None] | None) -> None:
        self._finish = finish
        self._done = False

    @abstractmethod
    def _wait_inner(self) -> None:
        """Block until the underlying operation completes."""

    @abstractmethod
    def _test_inner(self) -> bool:
        """Whether the underlying operation completed, without blocking."""

    def _release(self) -> None:
        """Drop what had to outlive the operation (called after ``finish``)."""

    def _complete(self) -> None:
        self._done = True
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        self._release()

    def wait(self) -> None:
        """Block until the operation completes, then run its follow-up."""
        if not self._done:
            self._wait_inner()
            self._complete()

    def test(self) -> bool:
        """True once the operation completed (its follow-up has then run); never blocks."""
        if not self._done and self._test_inner():
            self._complete()
        return self._done


class DoneHandle(Handle):
    """The handle of an operation that completed before it was returned."""

    def wait(self) -> None:
        """Return at once: nothing is pending."""

    def test(self) -> bool:
        """Always True."""
        return True


C = TypeVar("C", bound="Communicator")


class Communicator(ABC):
    """A group of ranks exchanging flat tensors.

    Semantics shared by every implementation:

    * ``allreduce`` and ``broadcast`` work **in place** on a contiguous tensor.
    * ``async_op=False`` (default) blocks and returns a completed handle; ``async_op=True`` returns at once
      and the tensor must not be touched until ``handle.wait()``.
    * ``isend`` may return before the data is delivered; the tensor must stay unchanged until ``wait()``.
    * The sum of an allreduce is taken in a fixed order for a fixed world size, so runs are reproducible.
    """

    #: Short name used in logs and the config (``[comm] backend``).
    name: str = "abstract"

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group, 0 ≤ rank < size."""

    @property
    @abstractmethod
    def size(self) -> int:
        """Number of ranks in the group."""

    @abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """Reduce ``tensor`` over all ranks, in place, leaving the result on every rank."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """Copy ``tensor`` from ``root`` into the same-shaped tensor on every other rank, in place."""

    @abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Start sending ``tensor`` to rank ``dst`` with message tag ``tag``."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """Start receiving into ``tensor`` from rank ``src`` with message tag ``tag``."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group has entered the barrier."""

    @abstractmethod
    def split(self, color: int, key: int | None = None) -> Communicator:
        """Partition the group: ranks with equal ``color`` form a new communicator, ordered by ``key``
        (default: current rank). Collective over the whole group."""

    def split_node(self) -> Communicator:
        """The ranks of this group that share this rank's node (shared memory), ordered by rank.

        Collective over the whole group. Implementations that cannot tell nodes apart raise
        NotImplementedError (the default), so a caller never mistakes a guess for the machine's layout.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot tell which ranks share a node")

    def split_apart(self, color: int, key: int | None = None) -> Communicator | None:
        """As :meth:`split`, but a group that survives apart: a lost rank inside it fails only its members'
        operations, and they recover without the rest of the job (elastic training's communicator,
        :meth:`~mpicrossbow.comm.elastic.ElasticCommunicator.split_apart`). None here: a communicator that
        cannot lose a rank has no such split, and a rule that asks (GSP's groups) splits plainly instead.
        Collective over the whole group when it returns one."""
        return None

    def share(self, tensor: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Place ``tensor``'s memory where this group sums it fastest: collective, every rank passes a tensor
        of the same size, views of it keep working. A no-op here; the shared-memory communicator moves it
        into node-shared memory, so its allreduces copy nothing in or out. Callers share the buffers they
        exchange every step (the pool's flat storage, a rule's exchange buffer), once."""

    @property
    def overlaps(self) -> bool:
        """Whether ``allreduce(..., async_op=True)`` proceeds while the caller computes: True for MPI's
        non-blocking collectives, torch.distributed's work objects and the in-process double. An
        implementation that completes the operation before returning says False, and BSP then skips gradient
        buckets (they would only add synchronisations)."""
        return True

    @property
    def exact(self) -> Communicator:
        """This group without lossy compression: ``self``, unless this is a compressing wrapper
        (:mod:`mpicrossbow.comm.compressed`). Rules use it for transfers that must arrive bit for bit."""
        return self

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """Sum ``tensor`` over the ranks in place, then divide it by ``count`` (the contributions summed:
        ranks × learners); blocking. Exactly ``allreduce`` then ``div_(count)``; an implementation may fold
        the division into its reduction (the shared-memory one divides each tile while it is in cache,
        saving a pass over the buffer)."""
        self.allreduce(tensor).wait()
        if count != 1:
            tensor.div_(count)

    def allreduce_scalars(self, values: list[float], op: ReduceOp = ReduceOp.SUM) -> list[float]:
        """Allreduce a short list of Python floats (metrics, counters) in float64; blocking."""
        t = torch.tensor(values, dtype=torch.float64)
        self.allreduce(t, op).wait()
        return t.tolist()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources held by the communicator (process groups, windows). Idempotent."""

    def _adopt(self, child: C) -> C:
        """Keep a communicator made by a split, so this one's ``close()`` closes it too; returns it."""
        self.__dict__.setdefault("_children", []).append(child)
        return child

    def _close_children(self) -> bool:
        """Mark this communicator closed and close what it adopted; False if it was closed already."""
        if self.__dict__.get("_closed", False):
            return False
        self._closed = True
        for child in self.__dict__.pop("_children", []):
            child.close()
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"
