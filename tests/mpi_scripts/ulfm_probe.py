"""What the elastic tests rely on in the Open MPI environment: one rank SIGKILLs itself, the survivors see a
process-failure error, revoke, shrink and agree. Run as ``mpiexec --with-ft ulfm -n N python ulfm_probe.py``;
prints ``SURVIVOR <old rank> <new rank> <new size> <agreed>`` on each survivor."""

from __future__ import annotations

import os
import signal

import numpy as np

from mpicrossbow.launch.fabric_probe import skip_fabric_probe
from mpicrossbow.launch.finalize_fence import skip_finalize_fence

skip_finalize_fence()  # before MPI_Init, as crossbow-launch does: the dead rank must not hold up MPI_Finalize
skip_fabric_probe()  # and, as it does, without libfabric's second-long probe on one node
from mpi4py import MPI  # noqa: E402

VICTIM = 1


def main() -> None:
    """Kill rank VICTIM, then recover on the others and print what they agreed on."""
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    value = np.ones(1)
    comm.Allreduce(MPI.IN_PLACE, value)  # every rank is up (a death inside MPI_Init is another matter)
    if comm.rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(10_000):
            comm.Allreduce(MPI.IN_PLACE, value)
    except MPI.Exception as exc:
        assert exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
    comm.Revoke()
    survivors = comm.Shrink()
    agreed = survivors.Agree(0b111 if survivors.rank else 0b101)
    print(f"SURVIVOR {comm.rank} {survivors.rank} {survivors.size} {agreed}", flush=True)
    survivors.Free()


if __name__ == "__main__":
    main()
