"""A rank lost in the middle of node-shared memory's allreduce, under ULFM: the survivors' waits end with
MPI's failure error (``notice_failures``), and a communicator built over the survivors sums again.

Run as ``mpiexec --with-ft ulfm -n 4 python shm_loss.py VICTIM PATH WHEN``: the four ranks form two
"nodes" of two (a split of one machine, as tests/mpi_scripts/shm_check.py fakes several nodes), so the sum
crosses nodes through the leaders (ranks 0 and 2). ``PATH`` is ``copy`` (a private tensor) or ``shared``
(zero-copy, the tensor moved into node-shared memory); ``WHEN`` is ``between`` (the victim dies before its
sixth allreduce) or ``inside`` (after that allreduce's first synchronisation: its peers wait at the second).
Each survivor prints ``NOTICED <rank> <error class> <ms after the victim's death>``, then, over the
survivors, ``AGAIN <rank> <sum>`` (the sum of every survivor's rank + 1).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from mpicrossbow.launch.finalize_fence import skip_finalize_fence

skip_finalize_fence()  # before MPI_Init, as crossbow-launch does: the dead rank must not hold up MPI_Finalize
from mpi4py import MPI  # noqa: E402

from mpicrossbow.comm.shm import SharedMemoryCommunicator  # noqa: E402

NUMEL = 1 << 16  # 256 KiB of float32: above the shared-memory path's threshold


def build(comm: MPI.Comm, fake_node: int) -> SharedMemoryCommunicator:
    """The communicator under test over ``comm``, its "node" the ranks of ``fake_node``."""
    node = comm.Split(fake_node, comm.Get_rank())
    return SharedMemoryCommunicator(comm, node=node, notice_failures=True)


def main() -> None:
    """Sum until the victim dies, notice it, shrink, sum over the survivors."""
    victim, path, when = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    world = MPI.COMM_WORLD.Dup()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    rank = world.Get_rank()
    shm = build(world, rank // 2)
    tensor = torch.full((NUMEL,), float(rank + 1))
    if path == "shared":
        shm.share(tensor)
    died = torch.zeros(1, dtype=torch.float64)  # when the victim dies, by the wall clock every rank reads
    for i in range(100):
        tensor.fill_(float(rank + 1))
        if rank == victim and i == 5:
            if when == "between":
                os.kill(os.getpid(), signal.SIGKILL)
            shm._agree = lambda: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
        if i == 5:
            died.fill_(time.time())
        try:
            shm.allreduce(tensor).wait()
        except MPI.Exception as exc:
            ms = (time.time() - float(died)) * 1e3
            print(f"NOTICED {rank} {exc.Get_error_class()} {ms:.0f}", flush=True)
            break
    else:
        print(f"MISSED {rank}", flush=True)
        return
    world.Revoke()
    survivors = world.Shrink()
    again = build(survivors, rank // 2)
    tensor = torch.full((NUMEL,), float(rank + 1))
    again.allreduce(tensor).wait()
    print(f"AGAIN {rank} {float(tensor[0]):g}", flush=True)


if __name__ == "__main__":
    main()
