"""A communicator that hands every operation to another: the base of the wrappers that change a few of them
(compression of large float buffers, :mod:`.compressed`; a drill's trap, training/health/drill.py), so each
states only what it changes and a new :class:`~.base.Communicator` method is forwarded in one place."""

from __future__ import annotations

import torch

from .base import Communicator, Handle, ReduceOp


class ForwardingCommunicator(Communicator):
    """Every operation of ``inner``, unchanged; ``close`` closes it (the wrapper owns it)."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner

    @property
    def name(self) -> str:  # type: ignore[override]
        """The inner communicator's name."""
        return self.inner.name

    @property
    def rank(self) -> int:
        """The inner rank."""
        return self.inner.rank

    @property
    def size(self) -> int:
        """The inner size."""
        return self.inner.size

    @property
    def overlaps(self) -> bool:
        """As the inner communicator."""
        return self.inner.overlaps

    @property
    def exact(self) -> Communicator:
        """This one when the inner communicator is exact itself, else the inner one's exact one."""
        inner = self.inner.exact
        return self if inner is self.inner else inner

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """The inner allreduce."""
        return self.inner.allreduce(tensor, op, async_op)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """The inner broadcast."""
        return self.inner.broadcast(tensor, root, async_op)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """The inner isend."""
        return self.inner.isend(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """The inner irecv."""
        return self.inner.irecv(tensor, src, tag)

    def barrier(self) -> None:
        """The inner barrier."""
        self.inner.barrier()

    def split(self, color: int, key: int | None = None) -> Communicator:
        """The inner split (not wrapped: a subclass that should carry on wraps it)."""
        return self.inner.split(color, key)

    def split_node(self) -> Communicator:
        """The inner node split (not wrapped, as :meth:`split`)."""
        return self.inner.split_node()

    def split_apart(self, color: int, key: int | None = None) -> Communicator | None:
        """The inner split apart."""
        return self.inner.split_apart(color, key)

    def share(self, tensor: torch.Tensor) -> None:
        """The inner share."""
        self.inner.share(tensor)

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """The inner mean."""
        self.inner.allreduce_mean(tensor, count)

    def allreduce_scalars(self, values: list[float], op: ReduceOp = ReduceOp.SUM) -> list[float]:
        """The inner scalar allreduce."""
        return self.inner.allreduce_scalars(values, op)

    def close(self) -> None:
        """Close the inner communicator."""
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
