"""Communicators: the interface rules talk to, its implementations, and the factory the session uses.

``MPICommunicator`` and ``TorchDistCommunicator`` are imported lazily, on first use: importing mpi4py starts
MPI, which a plain process (a unit test on :mod:`mpicrossbow.testing`'s threads, a config check) should not
pay for. The test doubles (a world of threads as ranks) live in :mod:`mpicrossbow.testing`, not here.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from mpicrossbow.comm.base import Communicator, DoneHandle, Handle, ReduceOp
from mpicrossbow.comm.compressed import COMPRESSIONS, CompressedCommunicator, wire_dtype
from mpicrossbow.config import CommSection
from mpicrossbow.config.fields import choices
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
    "MPICommunicator",
    "ReduceOp",
    "SharedMemoryCommunicator",
    "TorchDistCommunicator",
    "make_communicator",
]

log = logging.getLogger(__name__)

#: Valid values of ``[comm] backend``, ``shared_memory`` and ``compression``: the cfg section's own choices.
BACKENDS = choices(CommSection, "backend")
SHARED_MEMORY = choices(CommSection, "shared_memory")

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
    the measured machines) and ``nccl`` on CUDA. Raises :class:`ConfigError` for a device that cannot work,
    before any rank starts communicating."""
    device = torch.device(device)
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "mpi"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"[comm] backend = nccl needs a CUDA device, got {device}; use mpi or gloo")
    return backend


def agreed_backend(backend: str, device_types: list[str]) -> str:
    """``[comm] backend`` for a job whose ranks drive ``device_types`` (one per rank): as
    :func:`resolve_backend` when they agree; ``auto`` on a mix of CPU and CUDA ranks (CPU-only parameter
    servers beside GPU workers, ``DEVICES=cpu,cuda0,...``) is ``mpi`` on every rank — NCCL cannot reach a
    CPU rank, and MPI moves GPU tensors (CUDA-aware, or staged through pinned host memory)."""
    if backend == "auto" and len(set(device_types)) > 1:
        return "mpi"
    return resolve_backend(backend, device_types[0] if device_types else "cpu")


def make_communicator(
    section: CommSection,
    device: torch.device | str,
    mpi_comm: MPI.Comm | None = None,
    notice_failures: bool = False,
) -> Communicator:
    """Build the communicator ``[comm]`` describes for ``device`` over ``mpi_comm`` (default ``COMM_WORLD``);
    collective over its ranks.

    ``shared_memory`` picks :class:`SharedMemoryCommunicator` for the mpi backend on CPU: ``on`` always,
    ``auto`` when some node runs more than one rank of the job, ``off`` never; ``shm_window_mb`` and
    ``shm_min_kb`` tune it. ``compression`` (fp16, bf16) wraps the result in a
    :class:`CompressedCommunicator` that exchanges large float buffers 16-bit. ``interface`` goes to the
    torch.distributed backends' rendezvous (:mod:`mpicrossbow.comm.rendezvous`). ``notice_failures``
    (elastic training): node-shared memory's waits also ask MPI for the failures it knows of, so a lost rank
    ends them (:class:`SharedMemoryCommunicator`). The section's values were
    checked against their choices when it was built; this checks what depends on the device.
    """
    resolved = resolve_backend(section.backend, device)
    wire = wire_dtype(section.compression)
    shared_memory = section.shared_memory
    cpu = torch.device(device).type == "cpu"
    if mpi_comm is not None and mpi_comm.Get_size() > 1 and section.backend == "auto":
        kinds = mpi_comm.allgather(torch.device(device).type)  # every rank must pick the same backend
        resolved, cpu = agreed_backend("auto", kinds), all(kind == "cpu" for kind in kinds)
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
        comm: Communicator | None = None
        if shared_memory == "on":
            from mpicrossbow.comm.shm import SharedMemoryCommunicator, SharedMemoryUnavailable

            try:
                comm = SharedMemoryCommunicator(
                    world,
                    window_bytes=int(section.shm_window_mb * 2**20),
                    min_bytes=int(section.shm_min_kb * 2**10),
                    notice_failures=notice_failures,
                )
            except SharedMemoryUnavailable as exc:
                log.warning("the exchange goes through MPI, without node-shared memory: %s", exc)
        if comm is None:
            comm = MPICommunicator(world)
    else:
        from mpicrossbow.comm.torchdist import TorchDistCommunicator

        comm = TorchDistCommunicator.from_mpi(mpi_comm, backend=resolved, interface=section.interface)
    return comm if wire is None else CompressedCommunicator(comm, wire)
