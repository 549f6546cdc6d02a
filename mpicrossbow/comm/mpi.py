"""The mpi4py communicator: zero-copy on CPU tensors, CUDA-aware or pinned-host staging on GPU tensors.

A CPU tensor reaches MPI as ``tensor.detach().numpy()``, a view of the same memory, through mpi4py's
buffer-protocol (upper-case) methods: no copy, no pickling. Blocking calls use the blocking MPI function
(``Allreduce``, not ``Iallreduce`` + ``Wait``) because MPICH picks different, faster algorithms for it.

Dtypes: float32, float64, int32, int64 and uint8 reduce natively. float16 and bfloat16 have no portable MPI
reduction type, so they reduce through a float32 copy (sum accumulated in float32, rounded back once);
broadcast and point-to-point move them as raw 16-bit words, without a copy.

GPU tensors: if the MPI library is CUDA-aware (``MPI.Query_cuda_support()`` where mpi4py has it, overridden by
``MPICROSSBOW_CUDA_AWARE=0/1``) the device tensor goes to MPI directly, after the current stream is
synchronized. Otherwise an allreduce of more than one chunk (``MPICROSSBOW_STAGE_CHUNK``, default 4 MiB) goes
through :class:`~mpicrossbow.comm.staged_pipeline.StagedAllreduce`: chunks copied out and back on their own
CUDA streams through two pinned host halves while the host sums the chunk between them (by this
communicator's own allreduce of the host chunk, so a subclass's host path, shared memory, serves it too);
it is blocking, also with ``async_op``, which then returns a completed handle. Smaller allreduces, broadcast
and point-to-point are staged whole through a pinned host buffer (cached per dtype and size) and copied back
when the operation completes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from mpi4py import MPI

from mpicrossbow.comm.base import Communicator, DoneHandle, FollowUpHandle, Handle, ReduceOp
from mpicrossbow.comm.staged_pipeline import CudaStaging, StagedAllreduce
from mpicrossbow.comm.staged_pipeline import stage_chunk_bytes as _stage_chunk_bytes

log = logging.getLogger(__name__)

#: Dtypes MPI reduces directly on the tensor's memory.
NATIVE_REDUCE_DTYPES = frozenset({torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8})
#: Dtypes reduced through a float32 copy.
UPCAST_DTYPES = frozenset({torch.float16, torch.bfloat16})

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN}


def mpi_cuda_aware() -> bool:
    """Whether device pointers may be handed to this MPI: ``MPICROSSBOW_CUDA_AWARE`` if set, else the
    library's own answer (``MPI.Query_cuda_support``), else False — the safe choice, since a non-aware MPI
    crashes on device memory."""
    forced = os.environ.get("MPICROSSBOW_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except (MPI.Exception, NotImplementedError):
        return False


class MPIHandle(FollowUpHandle):
    """An MPI request plus what must happen after it completes (copy back from staging or float32)."""

    def __init__(self, request: MPI.Request, finish: Callable[[], None], keep: object) -> None:
        super().__init__(finish)
        self._request = request
        self._keep: object = keep  # the buffers MPI is using must outlive the request

    def _wait_inner(self) -> None:
        self._request.Wait()

    def _test_inner(self) -> bool:
        return bool(self._request.Test())

    def _release(self) -> None:
        self._keep = None


class MPICommunicator(Communicator):
    """A :class:`Communicator` over an mpi4py communicator (``COMM_WORLD`` by default).

    ``stage_chunk_bytes``: the chunk of the pipelined staging of CUDA allreduces on an MPI without CUDA
    support (module docstring); None: ``MPICROSSBOW_STAGE_CHUNK`` or 4 MiB; 0: always stage whole tensors.
    Every rank must use the same value.
    """

    name = "mpi"

    def __init__(
        self, comm: MPI.Comm | None = None, *, stage_chunk_bytes: int | None = None, _owned: bool = False
    ) -> None:
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self._owned = _owned  # True for communicators made by split(): close() frees them
        self._cuda_aware = mpi_cuda_aware()
        self._pinned: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.stage_chunk_bytes = _stage_chunk_bytes() if stage_chunk_bytes is None else stage_chunk_bytes
        # one pipelined staging (copy streams, pinned halves) per CUDA device, made on first use
        self._staging: dict[torch.device, StagedAllreduce[torch.cuda.Event]] = {}
        self._closed = False

    @property
    def mpi(self) -> MPI.Comm:
        """The underlying mpi4py communicator (the launcher uses it for Abort and bootstrap)."""
        return self._comm

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._comm.Get_rank()

    @property
    def size(self) -> int:
        """Number of ranks in the communicator."""
        return self._comm.Get_size()

    # -- buffers -------------------------------------------------------------------------------------

    def _buffer(
        self, tensor: torch.Tensor, reduce: bool, copy_in: bool, copy_out: bool
    ) -> tuple[object, Callable[[], None]]:
        """Return ``(buffer for MPI, finish callback)`` for ``tensor``; zero-copy whenever possible."""
        if not tensor.is_contiguous():
            raise ValueError("MPICommunicator needs a contiguous tensor; call .contiguous() first")
        work = tensor.detach()
        upcast = reduce and work.dtype in UPCAST_DTYPES
        if upcast:
            work = work.float()
        elif reduce and work.dtype not in NATIVE_REDUCE_DTYPES:
            raise TypeError(f"MPICommunicator cannot reduce {work.dtype}")
        elif work.dtype in UPCAST_DTYPES:  # moved, not reduced: ship the 16-bit words as they are
            work = work.view(torch.int16)
        host = work
        if work.is_cuda:
            if self._cuda_aware:
                torch.cuda.current_stream(work.device).synchronize()
                buf = work
            else:
                host = self._take_pinned(work.dtype, work.numel())
                if copy_in:
                    host.copy_(work.reshape(-1))
                buf = host.numpy()
        else:
            buf = work.numpy()

        def finish() -> None:
            if copy_out and host is not work:
                work.copy_(host.view_as(work))
            if copy_out and upcast:
                tensor.detach().copy_(work)
            if host is not work:
                self._pinned.setdefault((host.dtype, host.numel()), []).append(host)

        return buf, finish

    def _take_pinned(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A pinned host buffer from the cache (or a new one); returned to the cache when the op finishes."""
        free = self._pinned.get((dtype, numel))
        if free:
            return free.pop()
        log.debug("allocating a pinned staging buffer of %d x %s", numel, dtype)
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def _pipelines(self, tensor: torch.Tensor) -> bool:
        """Whether an allreduce of ``tensor`` takes the pipelined staging: CUDA, MPI without CUDA support,
        more than one chunk (a single chunk has nothing to overlap)."""
        return (
            tensor.is_cuda
            and not self._cuda_aware
            and 0 < self.stage_chunk_bytes < tensor.numel() * tensor.element_size()
        )

    def _staged_allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Sum ``tensor`` through the device's :class:`StagedAllreduce`, each host chunk reduced by this
        communicator's own allreduce (MPI's; a subclass's host path, such as shared memory, where it has
        one)."""
        if not tensor.is_contiguous():
            raise ValueError("MPICommunicator needs a contiguous tensor; call .contiguous() first")
        if tensor.dtype not in NATIVE_REDUCE_DTYPES | UPCAST_DTYPES:
            raise TypeError(f"MPICommunicator cannot reduce {tensor.dtype}")
        pipeline = self._staging.get(tensor.device)
        if pipeline is None:
            device = CudaStaging(tensor.device, self.stage_chunk_bytes)
            pipeline = self._staging[tensor.device] = StagedAllreduce(device, self.stage_chunk_bytes)
        pipeline(tensor.detach().view(-1), lambda host: self.allreduce(host, op).wait())

    def _finish(self, request: MPI.Request | None, buf: object, finish: Callable[[], None]) -> Handle:
        if request is None:
            finish()
            return DoneHandle()
        return MPIHandle(request, finish, buf)

    # -- operations ----------------------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """In-place ``MPI_Allreduce`` (``MPI_Iallreduce`` when ``async_op``) on the tensor's own memory.

        A CUDA tensor of more than ``stage_chunk_bytes`` on an MPI without CUDA support goes through the
        pipelined staging instead, blocking even with ``async_op`` (the handle returned is complete)."""
        if self._pipelines(tensor):
            self._staged_allreduce(tensor, op)
            return DoneHandle()
        buf, finish = self._buffer(tensor, reduce=True, copy_in=True, copy_out=True)
        if async_op:
            return self._finish(self._comm.Iallreduce(MPI.IN_PLACE, buf, _MPI_OPS[op]), buf, finish)
        self._comm.Allreduce(MPI.IN_PLACE, buf, _MPI_OPS[op])
        return self._finish(None, buf, finish)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """``MPI_Bcast`` (``MPI_Ibcast`` when ``async_op``) from ``root`` into every rank's tensor."""
        is_root = self.rank == root
        buf, finish = self._buffer(tensor, reduce=False, copy_in=is_root, copy_out=not is_root)
        if async_op:
            return self._finish(self._comm.Ibcast(buf, root), buf, finish)
        self._comm.Bcast(buf, root)
        return self._finish(None, buf, finish)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """``MPI_Isend`` of the tensor's memory; keep the tensor unchanged until ``wait()``."""
        buf, finish = self._buffer(tensor, reduce=False, copy_in=True, copy_out=False)
        return self._finish(self._comm.Isend(buf, dst, tag), buf, finish)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """``MPI_Irecv`` into the tensor's memory; the data is there after ``wait()``."""
        buf, finish = self._buffer(tensor, reduce=False, copy_in=False, copy_out=True)
        return self._finish(self._comm.Irecv(buf, src, tag), buf, finish)

    def barrier(self) -> None:
        """``MPI_Barrier``."""
        self._comm.Barrier()

    def split(self, color: int, key: int | None = None) -> MPICommunicator:
        """``MPI_Comm_split``; the new communicator is freed by its own or this one's ``close()``."""
        return self._adopt(
            MPICommunicator(
                self._comm.Split(color, self.rank if key is None else key),
                stage_chunk_bytes=self.stage_chunk_bytes,
                _owned=True,
            )
        )

    def split_node(self) -> MPICommunicator:
        """``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``: the ranks sharing this node's memory."""
        return self._adopt(
            MPICommunicator(
                self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank),
                stage_chunk_bytes=self.stage_chunk_bytes,
                _owned=True,
            )
        )

    def close(self) -> None:
        """Free the communicators made by :meth:`split` (never ``COMM_WORLD``) and the staging buffers and
        streams."""
        if not self._close_children():
            return
        self._pinned.clear()
        self._staging.clear()
        if self._owned and self._comm != MPI.COMM_NULL:
            self._comm.Free()
