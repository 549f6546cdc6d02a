"""Communicators: the interface rules talk to, its implementations, and the factory the session uses.

``MPICommunicator`` and ``TorchDistCommunicator`` are imported lazily, on first use: importing mpi4py starts
MPI, which a plain process (a unit test using :class:`InProcessWorld`, a config check) should not pay for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

from mpicrossbow.comm.base import Communicator, DoneHandle, Handle, ReduceOp
from mpicrossbow.comm.compressed import COMPRESSIONS, CompressedCommunicator, wire_dtype
from mpicrossbow.comm.inprocess import InProcessCommunicator, InProcessWorld, WorldAborted
from mpicrossbow.errors import ConfigError

if TYPE_CHECKING:
    from mpi4py import MPI

    from mpicrossbow.comm.mpi import MPICommunicator
    from mpicrossbow.comm.shm import SharedMemoryCommunicator
    from mpicrossbow.comm.torchdist import TorchDistCommunicator

__all__ = [
    "BACKENDS",
    "COMPRESSIONS",
    "SHARED_MEMORY",
    "Communicator",
    "CompressedCommunicator",
    "DoneHandle",
    "Handle",
    "InProcessCommunicator",
    "InProcessWorld",
    "MPICommunicator",
    "ReduceOp",
    "SharedMemoryCommunicator",
    "TorchDistCommunicator",
    "WorldAborted",
    "make_communicator",
]

#: Valid values of ``[comm] backend``.
BACKENDS = ("auto", "mpi", "gloo", "nccl")
#: Valid values of ``[comm] shared_memory``.
SHARED_MEMORY = ("auto", "on", "off")

_LAZY = {
    "MPICommunicator": "mpicrossbow.comm.mpi",
    "SharedMemoryCommunicator": "mpicrossbow.comm.shm",
    "TorchDistCommunicator": "mpicrossbow.comm.torchdist",
}


def __getattr__(name: str) -> Any:
    """Import the MPI-backed communicators on first access (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The concrete backend for ``backend`` on ``device``: ``auto`` is ``mpi`` on CPU (faster than Gloo on
    the measured machines) and ``nccl`` on CUDA. Raises :class:`ConfigError` for a name or device that
    cannot work, before any rank starts communicating."""
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ConfigError(f"[comm] backend = {backend!r} is unknown; valid: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "mpi"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"[comm] backend = nccl needs a CUDA device, got {device}; use mpi or gloo")
    return backend


def make_communicator(
    backend: str,
    device: torch.device | str,
    mpi_comm: MPI.Comm | None = None,
    compression: str = "none",
    shared_memory: str = "auto",
    window_bytes: int | None = None,
    min_bytes: int | None = None,
) -> Communicator:
    """Build the communicator for ``backend`` (one of :data:`BACKENDS`) and ``device`` over ``mpi_comm``
    (default ``COMM_WORLD``); collective over its ranks.

    ``shared_memory`` (one of :data:`SHARED_MEMORY`) picks :class:`SharedMemoryCommunicator` for the mpi
    backend on CPU: ``on`` always, ``auto`` when some node runs more than one rank of the job, ``off`` never.
    ``window_bytes`` and ``min_bytes`` tune it (defaults: its module's). ``compression`` (``[comm]
    compression``: none, fp16, bf16) wraps the result in a :class:`CompressedCommunicator` that exchanges
    large float buffers 16-bit.
    """
    resolved = resolve_backend(backend, device)
    wire = wire_dtype(compression)  # checked before any rank starts communicating
    if shared_memory not in SHARED_MEMORY:
        raise ConfigError(
            f"[comm] shared_memory = {shared_memory!r} is unknown; valid: {', '.join(SHARED_MEMORY)}"
        )
    cpu = torch.device(device).type == "cpu"
    if shared_memory == "on" and not (resolved == "mpi" and cpu):
        raise ConfigError(
            f"[comm] shared_memory = on needs backend mpi on a CPU device, got {resolved} on {device}"
        )
    if resolved == "mpi":
        from mpi4py import MPI

        from mpicrossbow.comm.mpi import MPICommunicator

        world = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if shared_memory == "auto" and cpu:
            node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
            shared_memory = "on" if world.allreduce(node.Get_size(), op=MPI.MAX) > 1 else "off"
            node.Free()
        if shared_memory == "on":
            from mpicrossbow.comm.shm import DEFAULT_MIN_BYTES, DEFAULT_WINDOW_BYTES, SharedMemoryCommunicator

            comm: Communicator = SharedMemoryCommunicator(
                world,
                window_bytes=DEFAULT_WINDOW_BYTES if window_bytes is None else window_bytes,
                min_bytes=DEFAULT_MIN_BYTES if min_bytes is None else min_bytes,
            )
        else:
            comm = MPICommunicator(world)
    else:
        from mpicrossbow.comm.torchdist import TorchDistCommunicator

        comm = TorchDistCommunicator.from_mpi(mpi_comm, backend=resolved)
    return comm if wire is None else CompressedCommunicator(comm, wire)
