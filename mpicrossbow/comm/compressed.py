"""16-bit exchange: a Communicator wrapper that puts float32/float64 buffers on the wire as fp16 or bf16.

``[comm] compression = fp16 | bf16`` makes :func:`mpicrossbow.comm.make_communicator` wrap the real
communicator in a :class:`CompressedCommunicator`, so every rule's exchanges halve their volume without a
change to the rule:

* ``allreduce``: the tensor is rounded to the wire type, the inner communicator reduces the 16-bit copy (MPI
  and the in-process double accumulate 16-bit sums in float32 and round once; NCCL reduces bf16/fp16
  natively), and the result is widened back into the caller's full-precision tensor.
* ``isend``: a 16-bit copy is sent and kept alive by the handle until the send completes. Its last
  :data:`EXACT_TAIL` (4) values travel bit-exact, ahead of the 16-bit body: the asynchronous rules'
  requests and replies end in control fields (flag, progress, counters) that must not be rounded.
* ``irecv``: the message lands in a 16-bit scratch buffer and is widened into the caller's tensor when the
  handle completes (``wait()``, or the ``test()`` that first returns True).
* ``broadcast``: the root's tensor is rounded, sent, and widened on every rank — the root's own tensor too,
  so all ranks hold the same values afterwards.

Rounding is to nearest even (``Tensor.copy_``). The 16-bit buffers are allocated once per size and reused
(a fresh 50 MB allocation costs more than the cast, its pages being faulted in on first touch): the wrapper
holds 2 bytes per element of each distinct buffer size it has exchanged, times the transfers in flight.

What is compressed: a contiguous float32 or float64 tensor of at least ``min_numel`` elements
(:data:`MIN_NUMEL`, 1024 by default). What never is: integer and bool tensors, tensors that are already
16-bit, and small tensors — metric and counter allreduces (``allreduce_scalars``, which also bypasses the
wrapper outright), the stop-signal agreement, GOSGD's float64 gossip weights. Only what travels is rounded:
the state a rule keeps (a parameter server's w, an EASGD centre, SMA's z) stays in full precision.

Exact on purpose: :attr:`Communicator.exact` gives the wrapped communicator, and the built-in rules use it
for the one-off transfers that build the model every rank validates or saves — the initial broadcast of
rank 0's weights in ``Rule.bind`` and each rule's ``sync_state`` — so compression changes only what the
learners exchange while they train.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mpicrossbow.comm.base import Communicator, DoneHandle, FollowUpHandle, Handle, ReduceOp
from mpicrossbow.errors import ConfigError

#: Valid values of ``[comm] compression`` and the wire dtype of each (None: no wrapper).
COMPRESSIONS: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
#: Dtypes that are rounded to the wire type; everything else passes through untouched.
COMPRESSIBLE_DTYPES = frozenset({torch.float32, torch.float64})
#: Tensors with fewer elements travel exactly (metrics, counters, flags; no bandwidth to save there).
MIN_NUMEL = 1024
#: Point-to-point messages keep their last values bit-exact: the request/reply protocols of the
#: asynchronous rules put their control fields there (a flag, the sender's progress, counters), which
#: rounding would corrupt (bf16 holds integers exactly only up to 256).
EXACT_TAIL = 4


def wire_dtype(compression: str) -> torch.dtype | None:
    """The 16-bit dtype for ``[comm] compression`` (None for ``none``); ConfigError for an unknown name."""
    if compression not in COMPRESSIONS:
        raise ConfigError(
            f"[comm] compression = {compression!r} is unknown; valid: {', '.join(COMPRESSIONS)}"
        )
    return COMPRESSIONS[compression]


class CompressedHandle(FollowUpHandle):
    """The inner operation's handle plus the widening step that must follow it and the buffer it uses.

    ``finish`` (copy the 16-bit result into the caller's tensor, then hand the buffer back for reuse) runs
    exactly once, when the inner operation is first seen complete; the 16-bit buffer is referenced until
    then, so it outlives the transfer.
    """

    def __init__(self, inner: Handle, wire: torch.Tensor, finish: Callable[[], None]) -> None:
        super().__init__(finish)
        self._inner = inner
        self._wire: torch.Tensor | None = wire

    @property
    def buffer(self) -> torch.Tensor | None:
        """The 16-bit buffer on the wire (None once the operation completed and released it)."""
        return self._wire

    def _wait_inner(self) -> None:
        self._inner.wait()

    def _test_inner(self) -> bool:
        return self._inner.test()

    def _release(self) -> None:
        self._wire = None


class CompressedCommunicator(Communicator):
    """Wraps a communicator so large float buffers travel as ``wire`` (fp16 or bf16); see the module doc."""

    def __init__(self, inner: Communicator, wire: torch.dtype, min_numel: int = MIN_NUMEL) -> None:
        if wire not in (torch.float16, torch.bfloat16):
            raise ValueError(f"wire dtype must be float16 or bfloat16, got {wire}")
        if min_numel < 1:
            raise ValueError(f"min_numel must be at least 1, got {min_numel}")
        self._inner, self.wire, self.min_numel = inner, wire, min_numel
        self.name = f"{inner.name}+{'bf16' if wire == torch.bfloat16 else 'fp16'}"
        # Free 16-bit buffers by (numel, device): a fresh allocation costs more than the cast itself (its
        # pages are faulted in on first touch), so each size is allocated once and reused.
        self._free: dict[tuple[int, torch.device], list[torch.Tensor]] = {}

    @property
    def exact(self) -> Communicator:
        """The wrapped communicator: the same ranks without compression."""
        return self._inner

    @property
    def overlaps(self) -> bool:
        """As the wrapped communicator."""
        return self._inner.overlaps

    @property
    def rank(self) -> int:
        """The inner communicator's rank."""
        return self._inner.rank

    @property
    def size(self) -> int:
        """The inner communicator's size."""
        return self._inner.size

    def compresses(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` travels 16-bit: float32/float64 with at least ``min_numel`` elements."""
        return tensor.dtype in COMPRESSIBLE_DTYPES and tensor.numel() >= self.min_numel

    def _take(self, tensor: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """A free 16-bit buffer of ``numel`` (default: ``tensor``'s count) on ``tensor``'s device."""
        if not tensor.is_contiguous():
            raise ValueError("CompressedCommunicator needs a contiguous tensor; call .contiguous() first")
        numel = tensor.numel() if numel is None else numel
        free = self._free.get((numel, tensor.device))
        if free:
            return free.pop()
        return torch.empty(numel, dtype=self.wire, device=tensor.device)

    def _give(self, wire: torch.Tensor) -> None:
        """Hand a buffer back once no transfer uses it any more."""
        self._free.setdefault((wire.numel(), wire.device), []).append(wire)

    def _narrow(self, tensor: torch.Tensor) -> torch.Tensor:
        """A 16-bit copy of ``tensor`` (rounded to nearest; the caller's memory is never on the wire)."""
        wire = self._take(tensor)
        wire.copy_(tensor.detach().reshape(-1))
        return wire

    def _finish(self, wire: torch.Tensor, into: torch.Tensor | None) -> Callable[[], None]:
        """What completion does: widen ``wire`` into ``into`` (if any), then reuse the buffer."""

        def finish() -> None:
            if into is not None:
                into.detach().copy_(wire.view_as(into))
            self._give(wire)

        return finish

    def _result(self, handle: Handle, wire: torch.Tensor, into: torch.Tensor | None, block: bool) -> Handle:
        wrapped = CompressedHandle(handle, wire, self._finish(wire, into))
        if block:
            wrapped.wait()
            return DoneHandle()
        return wrapped

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """Reduce a 16-bit copy (float32 accumulation in the inner communicator), widen into ``tensor``."""
        if not self.compresses(tensor):
            return self._inner.allreduce(tensor, op, async_op)
        wire = self._narrow(tensor)
        handle = self._inner.allreduce(wire, op, async_op)
        return self._result(handle, wire, tensor, block=not async_op)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """Broadcast the root's rounded tensor; every rank, the root included, ends with those values."""
        if not self.compresses(tensor):
            return self._inner.broadcast(tensor, root, async_op)
        wire = self._narrow(tensor)
        handle = self._inner.broadcast(wire, root, async_op)
        return self._result(handle, wire, tensor, block=not async_op)

    def _message(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """A free buffer for a point-to-point message of ``tensor``: the exact tail's raw bits first (so its
        view as ``tensor``'s dtype starts aligned), then the 16-bit body; and (tail words, body length)."""
        words = EXACT_TAIL * tensor.element_size() // 2
        body = tensor.numel() - EXACT_TAIL
        return self._take(tensor, words + body), words, body

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Send a 16-bit copy, its last :data:`EXACT_TAIL` values bit-exact (``tensor`` may change at once;
        the copy lives until completion)."""
        if not self.compresses(tensor) or tensor.numel() <= EXACT_TAIL:
            return self._inner.isend(tensor, dst, tag)
        wire, words, body = self._message(tensor)
        flat = tensor.detach().reshape(-1)
        wire[:words].view(tensor.dtype).copy_(flat[body:])
        wire[words:].copy_(flat[:body])
        return self._result(self._inner.isend(wire, dst, tag), wire, None, block=False)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """Receive into 16-bit scratch; widened into ``tensor`` (its exact tail copied) at completion."""
        if not self.compresses(tensor) or tensor.numel() <= EXACT_TAIL:
            return self._inner.irecv(tensor, src, tag)
        wire, words, body = self._message(tensor)

        def unpack() -> None:
            flat = tensor.detach().view(-1)
            flat[:body].copy_(wire[words:])
            flat[body:].copy_(wire[:words].view(tensor.dtype))
            self._give(wire)

        return CompressedHandle(self._inner.irecv(wire, src, tag), wire, unpack)

    def barrier(self) -> None:
        """The inner barrier."""
        self._inner.barrier()

    def split(self, color: int, key: int | None = None) -> CompressedCommunicator:
        """The inner split, compressed the same way."""
        return CompressedCommunicator(self._inner.split(color, key), self.wire, self.min_numel)

    def split_node(self) -> CompressedCommunicator:
        """The inner node split, compressed the same way."""
        return CompressedCommunicator(self._inner.split_node(), self.wire, self.min_numel)

    def allreduce_scalars(self, values: list[float], op: ReduceOp = ReduceOp.SUM) -> list[float]:
        """Metrics and counters: always exact (the inner communicator's float64 allreduce)."""
        return self._inner.allreduce_scalars(values, op)

    def close(self) -> None:
        """Close the inner communicator and drop the reusable buffers."""
        self._free.clear()
        self._inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r}, wire={self.wire})"
