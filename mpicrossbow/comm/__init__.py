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
    from mpicrossbow.comm.torchdist import TorchDistCommunicator

__all__ = [
    "BACKENDS",
    "COMPRESSIONS",
    "Communicator",
    "CompressedCommunicator",
    "DoneHandle",
    "Handle",
    "InProcessCommunicator",
    "InProcessWorld",
    "MPICommunicator",
    "ReduceOp",
    "TorchDistCommunicator",
    "WorldAborted",
    "make_communicator",
]

#: Valid values of ``[comm] backend``.
BACKENDS = ("auto", "mpi", "gloo", "nccl")

_LAZY = {
    "MPICommunicator": "mpicrossbow.comm.mpi",
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
    backend: str, device: torch.device | str, mpi_comm: MPI.Comm | None = None, compression: str = "none"
) -> Communicator:
    """Build the communicator for ``backend`` (one of :data:`BACKENDS`) and ``device`` over ``mpi_comm``
    (default ``COMM_WORLD``); collective over its ranks. ``compression`` (``[comm] compression``: none,
    fp16, bf16) wraps it in a :class:`CompressedCommunicator` that exchanges large float buffers 16-bit."""
    resolved = resolve_backend(backend, device)
    wire = wire_dtype(compression)  # checked before any rank starts communicating
    if resolved == "mpi":
        from mpicrossbow.comm.mpi import MPICommunicator

        comm: Communicator = MPICommunicator(mpi_comm)
    else:
        from mpicrossbow.comm.torchdist import TorchDistCommunicator

        comm = TorchDistCommunicator.from_mpi(mpi_comm, backend=resolved)
    return comm if wire is None else CompressedCommunicator(comm, wire)
