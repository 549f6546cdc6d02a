"""In-process test doubles: a world of threads, one per rank, so rule tests check exact math without MPI.

``InProcessWorld(4).run(fn)`` runs ``fn(comm)`` on four threads and returns the results in rank order.
Collectives meet at a :class:`threading.Barrier`; each rank deposits a copy of its tensor and computes the
result itself, reducing in rank order 0, 1, …, n-1 (16-bit floats accumulate in float32, as in the MPI
backend), so a numpy reference adding in that order matches bit for bit. Every operation completes before
it returns (``async_op`` is ignored). ``isend`` is buffered; ``irecv`` is bound at post time to the n-th
message of its (src, dst, tag) channel, as MPI matches receives in posting order. When a rank raises, every
other rank's pending wait raises :class:`WorldAborted` at once and ``run`` re-raises the first real error,
its rank named in a note; every wait ends in :class:`TimeoutError` after the world's timeout.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..comm.base import Communicator, DoneHandle, Handle, ReduceOp

T = TypeVar("T")

_REDUCE = {ReduceOp.SUM: torch.add, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}


class WorldAborted(RuntimeError):
    """Raised in a rank's pending collective or receive because another rank of its world failed."""


class _Shared:
    """What all groups of one run share: the abort flag, one condition guarding the mailboxes, the timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.aborted = threading.Event()
        self.cond = threading.Condition()
        self.groups: list[_Group] = []

    def abort(self) -> None:
        """Wake every waiter of every group: barriers break, receives see the flag."""
        with self.cond:
            self.aborted.set()
            self.cond.notify_all()
            for group in self.groups:
                group.barrier.abort()


class _Group:
    """One world or sub-world: the barrier and slots its collectives meet at, and its point-to-point mail."""

    def __init__(self, shared: _Shared, size: int) -> None:
        self.shared, self.size, self.barrier = shared, size, threading.Barrier(size)
        self.slots: list[object] = [None] * size
        self.mail: defaultdict[tuple[int, int, int], list[torch.Tensor | None]] = defaultdict(list)
        self.posted: defaultdict[tuple[int, int, int], int] = defaultdict(int)  # receives per channel
        self.splits: dict[tuple[int, int], _Group] = {}
        with shared.cond:
            shared.groups.append(self)
            if shared.aborted.is_set():
                self.barrier.abort()


class _RecvHandle(Handle):
    """A posted receive: bound to the n-th message of one (src, dst, tag) channel."""

    def __init__(
        self, comm: InProcessCommunicator, tensor: torch.Tensor, channel: tuple[int, int, int], index: int
    ) -> None:
        self._comm, self._tensor, self._channel, self._index, self._done = comm, tensor, channel, index, False

    def _take(self) -> bool:
        """Copy the message in if it has arrived; caller holds the condition."""
        box = self._comm._group.mail[self._channel]
        if len(box) <= self._index:
            return False
        msg, box[self._index] = box[self._index], None
        assert msg is not None
        if (msg.dtype, msg.numel()) != (self._tensor.dtype, self._tensor.numel()):
            raise ValueError(
                f"irecv on {self._comm._label}: {msg.numel()} x {msg.dtype} sent, buffer differs"
            )
        self._tensor.detach().copy_(msg.view_as(self._tensor))
        self._done = True
        return True

    def test(self) -> bool:
        """True once the message is in the tensor; never blocks."""
        if not self._done:
            with self._comm._shared.cond:
                self._comm._check_abort("irecv")
                self._take()
        return self._done

    def wait(self) -> None:
        """Block until the matching message arrives (bounded by the world timeout) and copy it in."""
        shared = self._comm._shared
        deadline = time.monotonic() + shared.timeout_s
        with shared.cond:
            while not self._done and not self._take():
                self._comm._check_abort("irecv")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    src, _, tag = self._channel
                    what = f"irecv(src={src}, tag={tag}) on {self._comm._label}"
                    raise TimeoutError(f"{what} timed out after {shared.timeout_s}s")
                shared.cond.wait(remaining)


class InProcessCommunicator(Communicator):
    """One rank of an :class:`InProcessWorld` (or of a sub-world made by :meth:`split`)."""

    name = "inprocess"

    def __init__(self, group: _Group, rank: int, label: str | None = None, node: int = 0) -> None:
        self._group, self._shared, self._rank = group, group.shared, rank
        self._label = label or f"rank {rank}"
        self._splits_done = 0
        self._node = node

    @property
    def rank(self) -> int:
        """This thread's rank in its (sub-)world."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the (sub-)world."""
        return self._group.size

    def _check_abort(self, op: str) -> None:
        if self._shared.aborted.is_set():
            raise WorldAborted(f"{op} on {self._label}: another rank of the world failed")

    def _exchange(self, op: str, value: object) -> list[Any]:
        """Deposit ``value``, wait for all ranks, return every rank's value in rank order."""
        self._check_abort(op)
        self._group.slots[self._rank] = value
        self._meet(op)
        values = list(self._group.slots)
        self._meet(op)  # nobody overwrites a slot before everyone has read them all
        return values

    def _meet(self, op: str) -> None:
        try:
            self._group.barrier.wait(timeout=self._shared.timeout_s)
        except threading.BrokenBarrierError:
            self._check_abort(op)
            raise TimeoutError(f"{op} on {self._label} timed out after {self._shared.timeout_s}s") from None

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"{what}={peer} out of range for a world of size {self.size}")

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """Reduce in rank order 0..n-1 (float32 accumulation for 16-bit floats) into every rank's tensor."""
        values = self._exchange("allreduce", tensor.detach().clone())
        if any(v.shape != tensor.shape or v.dtype != tensor.dtype for v in values):
            raise ValueError(f"allreduce on {self._label}: ranks passed different shapes or dtypes")
        acc_dtype = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype
        acc = values[0].to(acc_dtype)
        for value in values[1:]:
            acc = _REDUCE[op](acc, value.to(acc_dtype))
        tensor.detach().copy_(acc)
        return DoneHandle()

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """Copy ``root``'s tensor into every other rank's tensor."""
        self._check_peer(root, "root")
        values = self._exchange("broadcast", tensor.detach().clone() if self._rank == root else None)
        if self._rank != root:
            tensor.detach().copy_(values[root])
        return DoneHandle()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Buffered send: a copy of ``tensor`` goes into the (self, dst, tag) channel now."""
        self._check_peer(dst, "dst")
        msg = tensor.detach().clone()
        with self._shared.cond:
            self._group.mail[(self._rank, dst, tag)].append(msg)
            self._shared.cond.notify_all()
        return DoneHandle()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """Post a receive matched to the next unclaimed message of the (src, self, tag) channel."""
        self._check_peer(src, "src")
        with self._shared.cond:
            channel = (src, self._rank, tag)
            index = self._group.posted[channel]
            self._group.posted[channel] += 1
        return _RecvHandle(self, tensor, channel, index)

    def barrier(self) -> None:
        """Wait until every rank of the (sub-)world is here."""
        self._exchange("barrier", None)

    def split(self, color: int, key: int | None = None) -> InProcessCommunicator:
        """Sub-worlds by ``color``, ranks ordered by ``key`` then old rank, as ``MPI_Comm_split`` does."""
        values = self._exchange("split", (color, self._rank if key is None else key))
        members = sorted((k, r) for r, (c, k) in enumerate(values) if c == color)
        new_rank = [r for _, r in members].index(self._rank)
        with self._shared.cond:  # the first member to get here makes the sub-world
            if (self._splits_done, color) not in self._group.splits:
                self._group.splits[(self._splits_done, color)] = _Group(self._shared, len(members))
            group = self._group.splits[(self._splits_done, color)]
        self._splits_done += 1
        label = f"{self._label} (rank {new_rank} of split {color})"
        return InProcessCommunicator(group, new_rank, label, node=self._node)

    def split_node(self) -> InProcessCommunicator:
        """The ranks of the same simulated node (:class:`InProcessWorld`'s ``ranks_per_node``)."""
        return self.split(self._node)


class InProcessWorld:
    """``size`` ranks as threads; :meth:`run` gives each an :class:`InProcessCommunicator`."""

    def __init__(self, size: int, timeout_s: float = 30.0, ranks_per_node: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"world size must be at least 1, got {size}")
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        self.size = size
        self.timeout_s = timeout_s
        #: Simulated nodes for :meth:`InProcessCommunicator.split_node`: ranks r // ranks_per_node share
        #: one (None: every rank on one node).
        self.ranks_per_node = ranks_per_node or size

    def run(self, fn: Callable[[Communicator], T]) -> list[T]:
        """Run ``fn(comm)`` on every rank; return the results in rank order or re-raise the first error."""
        shared = _Shared(self.timeout_s)
        root = _Group(shared, self.size)
        results: list[T | None] = [None] * self.size
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(InProcessCommunicator(root, rank, node=rank // self.ranks_per_node))
            except BaseException as exc:
                with shared.cond:
                    errors.append((rank, exc))
                shared.abort()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:  # wait for all; after an abort, give stragglers one timeout to notice
            while thread.is_alive() and not shared.aborted.is_set():
                thread.join(0.05)
            thread.join(self.timeout_s)
            if thread.is_alive():
                stuck = [r for r, t in enumerate(threads) if t.is_alive()]
                raise TimeoutError(f"in-process ranks {stuck} still running {self.timeout_s}s after an abort")
        if errors:
            rank, exc = next(((r, e) for r, e in errors if not isinstance(e, WorldAborted)), errors[0])
            if hasattr(exc, "add_note"):
                exc.add_note(f"raised on in-process rank {rank} of {self.size}")
                raise exc
            raise RuntimeError(f"in-process rank {rank} of {self.size} raised {exc!r}") from exc
        return results  # type: ignore[return-value]
