"""MPICommunicator's own behaviour under a real ``mpiexec``, beyond the Communicator contract
(tests/test_communicator_contract.py): MPI is handed the tensor's own memory, and the factory and the
CUDA-awareness switch choose as documented.

``CHECKS`` runs in the contract's launch (``--also mpi_check``); tests/test_comm_mpi.py asserts the verdicts.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from mpi4py import MPI
from verdicts import WORLD

from mpicrossbow.comm import make_communicator
from mpicrossbow.comm.mpi import MPICommunicator, mpi_cuda_aware
from mpicrossbow.comm.torchdist import TorchDistCommunicator
from mpicrossbow.config import CommSection


class SpyComm:
    """Forwards to a real mpi4py communicator and records the address of each buffer handed to MPI."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm, self.addresses = comm, []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.comm, name)

        def call(*args: object) -> object:
            self.addresses.append((args[1] if args[0] is MPI.IN_PLACE else args[0]).ctypes.data)
            return attr(*args)

        return call if name in ("Allreduce", "Iallreduce", "Bcast", "Ibcast", "Isend", "Irecv") else attr


def check_buffers() -> None:
    """MPI is handed the tensor's own memory (no copy) by every operation."""
    spy = SpyComm(WORLD)
    comm = MPICommunicator(spy)  # type: ignore[arg-type]
    t, out = torch.arange(1000.0), torch.arange(1000.0)
    comm.allreduce(t)
    comm.allreduce(t, async_op=True).wait()
    comm.broadcast(t, 0)
    h = comm.irecv(t, (WORLD.rank - 1) % WORLD.size)
    comm.isend(out, (WORLD.rank + 1) % WORLD.size).wait()
    h.wait()
    assert spy.addresses == [t.data_ptr()] * 4 + [out.data_ptr()], "MPI got a copy, not the tensor's memory"


def check_factory() -> None:
    """``auto`` is MPI on CPU; NCCL without CUDA is refused; ``MPICROSSBOW_CUDA_AWARE`` overrides the
    query."""
    comm = make_communicator(CommSection(), torch.device("cpu"))
    assert isinstance(comm, MPICommunicator), type(comm).__name__
    comm.close()
    if not torch.cuda.is_available():
        try:
            TorchDistCommunicator.from_mpi(backend="nccl")
        except ValueError:
            pass
        else:
            raise AssertionError("nccl without CUDA did not raise ValueError")
    for value, want in (("0", False), ("1", True)):
        os.environ["MPICROSSBOW_CUDA_AWARE"] = value
        assert mpi_cuda_aware() is want, f"MPICROSSBOW_CUDA_AWARE={value} ignored"
    del os.environ["MPICROSSBOW_CUDA_AWARE"]


CHECKS: list[tuple[str, Callable[[], None]]] = [("buffers", check_buffers), ("factory", check_factory)]
