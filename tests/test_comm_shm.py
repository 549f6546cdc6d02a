"""The shared-memory hierarchical allreduce under a real ``mpiexec``: sums in the documented order at 1-4
ranks (one launch per world size runs every dtype and size, tests/mpi_scripts/shm_check.py), a simulated
two-node job, and no shared-memory segment left in ``/dev/shm`` after a clean run or a failed one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mpicrossbow.comm import make_communicator
from mpicrossbow.errors import ConfigError
from tests.conftest import run_mpi
from tests.test_comm_mpi import verdicts

SCRIPT = Path(__file__).parent / "mpi_scripts" / "shm_check.py"
CHECKS = [
    "one_node",
    "chunks",
    "two_nodes",
    "every_rank_a_node",
    "shared_buffer",
    "mismatch",
    "delegated",
    "factory",
]
SHM = Path("/dev/shm")
#: MPICH's own intra-node segment (``mpich_shm_<id>_0``), which MPI_Abort leaves behind whether or not the
#: job allocated a window (measured with a job that only calls Allreduce and Abort); windows are
#: ``mpich_shar_tmp*``, Open MPI's ``*osc*``/``*sm*`` segments.
MPI_ABORT_LEFTOVER = "mpich_shm_"


def segments() -> set[str]:
    """Names in /dev/shm now."""
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shared_memory_allreduce(mpiexec: str, n: int) -> None:
    """Every check passes at world size n, and the run leaves no new segment in /dev/shm."""
    before = segments()
    proc = run_mpi(mpiexec, n, [sys.executable, str(SCRIPT)], timeout=300)
    found = verdicts(proc.stdout)
    failed = {k: v for k, v in found.items() if v != "OK"}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
    assert proc.returncode == 0 and "DONE" in proc.stdout, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    assert [c for c in CHECKS if found.get(c) != "OK"] == []
    assert segments() - before == set(), "a shared-memory segment was left in /dev/shm"


@pytest.mark.mpi
def test_no_segment_left_after_a_rank_fails(mpiexec: str) -> None:
    """A rank raises with the window in use and the job is aborted: no window segment stays behind."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this system")
    before = segments()
    proc = run_mpi(mpiexec, 2, [sys.executable, str(SCRIPT), "--fail"], timeout=120)
    assert proc.returncode != 0 and "injected failure" in proc.stderr, proc.stderr[-4000:]
    left = {name for name in segments() - before if not name.startswith(MPI_ABORT_LEFTOVER)}
    assert left == set(), f"segments left in /dev/shm: {sorted(left)}"


def test_shared_memory_setting_is_checked() -> None:
    """A bad ``[comm] shared_memory`` value, or ``on`` where the path cannot run, is a ConfigError."""
    with pytest.raises(ConfigError, match="auto, on, off"):
        make_communicator("mpi", torch.device("cpu"), shared_memory="yes")
    with pytest.raises(ConfigError, match="needs backend mpi"):
        make_communicator("gloo", torch.device("cpu"), shared_memory="on")
