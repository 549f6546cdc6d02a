"""A chunked, double-buffered allreduce of a device tensor through pinned host memory, for an MPI without
device pointers.

An MPI built without CUDA support (the PyPI wheels are) cannot be handed device memory, so a CUDA tensor is
summed on the host. One whole-tensor copy out, MPI, one whole copy back leaves the copy engines idle while
the host sums and the host idle while they copy (measured on an H100, 2 ranks sharing the GPU: 16 MB at
3.3 GB/s, 100 MB at 1.5 GB/s, where a pinned copy runs at tens of GB/s). :class:`StagedAllreduce` cuts the
tensor into chunks of :data:`STAGE_CHUNK_BYTES` and keeps three things in flight:

* chunk i+1 is copied off the device (a dedicated copy stream, into one half of a pinned host buffer)
* while the host reduces chunk i, in the other half (the caller's host allreduce: MPI's, or the node
  shared-memory one of :class:`~mpicrossbow.comm.shm.SharedMemoryCommunicator`),
* while chunk i-1 is copied back to the device (a second copy stream).

Ordering, by events only (no device-wide synchronisation): the host waits for chunk i's copy-out event
before reducing it; chunk i's copy-back is issued only after its reduction returned; the copy-out of chunk
i+2 into the half chunk i used waits (on the device, not the host) for the event of chunk i's copy-back, so
a half is never overwritten before the device has read it back; the call returns after the host waited for
the last copy-back, so the tensor holds the sum, as a blocking allreduce promises. With copies faster than
the host sum, the time is about that of the reductions plus one chunk's copy out and back.

The pipeline talks to a small device seam, :class:`StagingDevice` (copy out, copy in, wait, the pinned
halves); :class:`CudaStaging` implements it with torch.cuda streams and events. The tests drive the same
pipeline with a stand-in device whose copies are deferred CPU copies, to check the ordering without a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

log = logging.getLogger(__name__)

#: Bytes per chunk, by default. Each chunk costs a fixed overhead (an MPI call's latency, an event wait, two
#: copy launches: tens of microseconds) and the pipeline's fill and drain cost about one chunk's copy out
#: and back. At 4 MiB a pinned copy takes ~0.2 ms at ~25 GB/s, so the fixed costs stay under ~10% of it,
#: while a 16 MB tensor is still 4 chunks (fill and drain ~1/4 of the copies) and 100 MB is 25. The pinned
#: buffer is 2 x 4 MiB per device. To be tuned on a GPU (benchmarks/exchange.py --stage-chunks).
STAGE_CHUNK_BYTES = 4 << 20
#: Environment variable overriding :data:`STAGE_CHUNK_BYTES` (bytes, or with a K/M/G suffix; 0 turns the
#: pipeline off: whole-tensor staging). It must be the same on every rank, as every chunk is a collective.
STAGE_CHUNK_ENV = "MPICROSSBOW_STAGE_CHUNK"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

_E = TypeVar("_E")


def stage_chunk_bytes() -> int:
    """The chunk size in bytes: ``MPICROSSBOW_STAGE_CHUNK`` if set (``4M``, ``65536``; 0 = no pipeline), else
    :data:`STAGE_CHUNK_BYTES`. Raises ValueError on a value that is not a size, rather than guess."""
    text = os.environ.get(STAGE_CHUNK_ENV, "").strip().upper()
    if not text:
        return STAGE_CHUNK_BYTES
    scale = _UNITS.get(text[-1], 1)
    digits = text[:-1] if text[-1] in _UNITS else text
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise ValueError(f"{STAGE_CHUNK_ENV}={text!r} is not a size in bytes (e.g. 4M, 65536, 0)") from None
    if value < 0:
        raise ValueError(f"{STAGE_CHUNK_ENV}={text!r} is negative")
    return value


class StagingDevice(Protocol[_E]):
    """What :class:`StagedAllreduce` needs from the device a tensor lives on: two pinned host halves, an
    asynchronous copy out and one back, each returning an event, and a host-side wait for an event."""

    def begin(self) -> None:
        """Order the copies after the work already queued on the tensor (the caller's current stream)."""

    def host(self, half: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Host buffer ``half`` (0 or 1) as ``numel`` elements of ``dtype`` (at most one chunk's bytes)."""
        ...

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor, after: _E | None) -> _E:
        """Queue the copy device ``src`` → host ``dst``, to start once ``after`` (an event of
        :meth:`copy_in`, or None) has completed; return the event of its completion."""
        ...

    def wait(self, event: _E) -> None:
        """Block the host until ``event`` has completed."""

    def copy_in(self, src: torch.Tensor, dst: torch.Tensor) -> _E:
        """Queue the copy host ``src`` → device ``dst``; return the event of its completion."""
        ...


class StagedAllreduce(Generic[_E]):
    """The chunked, double-buffered pipeline (module docstring) over one :class:`StagingDevice`.

    ``pipeline(flat, reduce)`` sums a flat contiguous device tensor in place: ``reduce(host)`` must reduce a
    host tensor in place and return when done (a communicator's blocking allreduce). Keep one per device and
    reuse it: its pinned halves and the events of their last reads carry over from call to call.
    """

    def __init__(self, device: StagingDevice[_E], chunk_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._reads: list[_E | None] = [None, None]  # per half: the copy-back that last read it

    def __call__(self, flat: torch.Tensor, reduce: Callable[[torch.Tensor], None]) -> None:
        """Sum ``flat`` (1-D, contiguous) over the ranks in place, chunk by chunk; blocking."""
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("StagedAllreduce needs a flat contiguous tensor")
        if flat.numel() == 0:
            return
        step = max(1, self.chunk_bytes // flat.element_size())
        chunks = list(flat.split(step))
        self.device.begin()
        outs = [self._copy_out(chunks, 0)]
        back: _E | None = None
        try:
            for i, chunk in enumerate(chunks):
                if i + 1 < len(chunks):
                    outs.append(self._copy_out(chunks, i + 1))  # overlaps the reduction of chunk i
                host = self._await_copy_out(outs[i], i, chunk)
                reduce(host)
                back = self._copy_back(host, chunk, i)
        except BaseException:
            for event in [*outs, back]:  # leave no copy writing into the pinned halves
                if event is not None:
                    self.device.wait(event)
            raise
        assert back is not None
        self._finish(back)

    def _copy_out(self, chunks: list[torch.Tensor], j: int) -> _E:
        """Queue chunk j's copy into half j % 2, after the copy-back that last read that half."""
        half = j % 2
        host = self.device.host(half, chunks[j].dtype, chunks[j].numel())
        return self.device.copy_out(chunks[j], host, after=self._reads[half])

    def _await_copy_out(self, event: _E, i: int, chunk: torch.Tensor) -> torch.Tensor:
        """Wait for chunk i's copy-out; its host half, ready to reduce."""
        self.device.wait(event)
        return self.device.host(i % 2, chunk.dtype, chunk.numel())

    def _copy_back(self, host: torch.Tensor, chunk: torch.Tensor, i: int) -> _E:
        """Queue the reduced chunk i back into the tensor; its event guards half i % 2."""
        event = self.device.copy_in(host, chunk)
        self._reads[i % 2] = event
        return event

    def _finish(self, last: _E) -> None:
        """Wait for the last copy-back (copy-backs run in order on one stream): the tensor holds the sum."""
        self.device.wait(last)


class CudaStaging:
    """:class:`StagingDevice` on one CUDA device: a copy-out stream, a copy-in stream, two pinned halves of
    ``chunk_bytes`` (allocated on first use, kept), ``torch.cuda.Event`` for every copy."""

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._out = torch.cuda.Stream(device)
        self._in = torch.cuda.Stream(device)
        self._halves: list[torch.Tensor] = []

    def begin(self) -> None:
        """Both copy streams wait for what the current stream has queued (the kernels producing the tensor,
        or still reading it)."""
        queued = torch.cuda.current_stream(self.device).record_event()
        self._out.wait_event(queued)
        self._in.wait_event(queued)

    def host(self, half: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Pinned half ``half`` viewed as ``numel`` elements of ``dtype``."""
        if not self._halves:
            log.debug("allocating 2 pinned staging halves of %d B for %s", self.chunk_bytes, self.device)
            self._halves = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in "01"]
        nbytes = numel * dtype.itemsize
        if nbytes > self.chunk_bytes:
            raise ValueError(f"{nbytes} B do not fit a {self.chunk_bytes} B staging half")
        return self._halves[half][:nbytes].view(dtype)

    def copy_out(
        self, src: torch.Tensor, dst: torch.Tensor, after: torch.cuda.Event | None
    ) -> torch.cuda.Event:
        """Device → pinned host on the copy-out stream, after ``after`` (waited on the device)."""
        with torch.cuda.stream(self._out):
            if after is not None:
                self._out.wait_event(after)
            dst.copy_(src, non_blocking=True)
            return self._out.record_event()

    def wait(self, event: torch.cuda.Event) -> None:
        """The host waits for this one event (not for the whole device)."""
        event.synchronize()

    def copy_in(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event:
        """Pinned host → device on the copy-in stream."""
        with torch.cuda.stream(self._in):
            dst.copy_(src, non_blocking=True)
            return self._in.record_event()
