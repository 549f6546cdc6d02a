"""The shared-memory hierarchical allreduce's own behaviour under a real ``mpiexec`` (its Communicator
contract is tests/test_communicator_contract.py's): sums in the documented order through chunked windows, fake
multi-node jobs and window-backed buffers at 1-4 ranks (tests/mpi_scripts/shm_check.py, run in the shared
communicator job of each world size), and no shared-memory segment left in ``/dev/shm`` after a clean run or a
failed one."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import COMM_JOB_SIZES, CommJob, run_mpi
from mpicrossbow.comm import make_communicator
from mpicrossbow.config import CommSection, load_config
from mpicrossbow.errors import ConfigError

SCRIPT = Path(__file__).parent / "mpi_scripts" / "shm_check.py"
CHECKS = [
    "one_node",
    "chunks",
    "two_nodes",
    "every_rank_a_node",
    "shared_buffer",
    "share",
    "mismatch",
    "factory",
]
SHM = Path("/dev/shm")


def segments(stdout: str) -> dict[str, set[Path]]:
    """``{"mpi": ..., "window": ...}``: the /dev/shm files the job mapped before any window and since, as
    its rank 0 reported them (so other jobs on the machine do not count)."""
    found: dict[str, set[Path]] = {"mpi": set(), "window": set()}
    for line in stdout.splitlines():
        if line.startswith("SEGMENT "):
            _, kind, path = line.split(" ", 2)
            found[kind].add(Path(path.removesuffix(" (deleted)")))
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("n", COMM_JOB_SIZES)
def test_shared_memory_allreduce(comm_job: Callable[[int], CommJob], n: int) -> None:
    """Every check passes at world size n, and no segment the job mapped is left in /dev/shm."""
    job = comm_job(n)
    found = job.verdicts("shm_check")
    failed = [f"{c}: {found.get(c, 'not reported')}" for c in CHECKS if found.get(c) != "OK"]
    assert not failed, "\n".join(failed) + job.tail()
    mapped = segments(job.stdout)
    if SHM.is_dir():
        # (one rank: MPICH backs the window with private memory, no file)
        assert mapped["window"] or n == 1, "the job reported no window segment: the check proves nothing"
        left = [p for p in mapped["window"] | mapped["mpi"] if p.exists()]
        assert left == [], f"left in /dev/shm: {left}"


@pytest.mark.mpi
def test_no_segment_left_after_a_rank_fails(mpiexec: str) -> None:
    """A rank raises with windows and shared tensors in use and the job is aborted: no segment stays behind.

    (MPICH's own intra-node segment, mapped before any window, is left by MPI_Abort whether or not the job
    made a window — measured with a job that only calls Allreduce and Abort — so only windows count.)"""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this system")
    proc = run_mpi(mpiexec, 2, [sys.executable, str(SCRIPT), "--fail"], timeout=120)
    assert proc.returncode != 0 and "injected failure" in proc.stderr, proc.stderr[-4000:]
    windows = segments(proc.stdout)["window"]
    assert windows, "the job reported no window segment: the check would prove nothing"
    assert [p for p in windows if p.exists()] == []


def test_shared_memory_setting_is_checked() -> None:
    """A bad ``[comm] shared_memory`` value, or ``on`` where the path cannot run, is a ConfigError."""
    with pytest.raises(ConfigError, match="auto, on, off"):
        load_config(text="RULE=BSP\nMODELFILE=m\nMODELCLASS=M\nDEVICES=cpu\n[comm]\nshared_memory = yes\n")
    with pytest.raises(ConfigError, match="needs backend mpi"):
        make_communicator(CommSection(backend="gloo", shared_memory="on"), torch.device("cpu"))


def test_the_fence_is_none_on_x86_64_and_libatomics_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The descriptor-backed window's fence (elastic training): no instruction on x86-64 (TSO), libatomic's
    ``atomic_thread_fence`` on other machines, and no window at all where libatomic is missing there."""
    from mpicrossbow.comm import shm

    monkeypatch.setattr(shm.platform, "machine", lambda: "x86_64")
    assert shm._fence() is not None and shm._fence()() is None
    monkeypatch.setattr(shm.platform, "machine", lambda: "aarch64")
    try:
        shm.ctypes.CDLL("libatomic.so.1")
    except OSError:
        pytest.skip("no libatomic here")
    fence = shm._fence()
    assert fence is not None and fence.args == (5,)  # memory_order_seq_cst
    fence()

    def missing(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(shm.ctypes, "CDLL", missing)
    assert shm._fence() is None


def test_an_elastic_wait_asks_mpi_every_32nd_poll_while_it_yields_and_after_every_nap() -> None:
    """ULFM raises a peer's failure only in an MPI call, and needs a few: a wait on the shared window asks
    (``MPI_Iprobe``) every :data:`~mpicrossbow.comm.shm.ASK_EVERY`-th poll while polls are microseconds
    apart, and after every nap once they are a millisecond apart (every 32nd nap let a SIGKILLed peer's
    survivors wait 160-270 ms); without ``notice_failures`` it never asks."""
    from types import SimpleNamespace

    from mpicrossbow.comm.shm import ASK_EVERY, SharedMemoryCommunicator

    asked: list[int] = []
    for notice in (True, False):
        probe = SimpleNamespace(Iprobe=lambda *args: asked.append(1))
        fake = SimpleNamespace(notice_failures=notice, _comm=probe)
        polls = range(1, 3 * ASK_EVERY + 1)
        for poll in polls:  # yielding
            SharedMemoryCommunicator._ask_mpi(fake, poll, False)  # type: ignore[arg-type]
        yielding = len(asked)
        for poll in polls:  # napping
            SharedMemoryCommunicator._ask_mpi(fake, poll, True)  # type: ignore[arg-type]
        assert (yielding, len(asked) - yielding) == ((3, 3 * ASK_EVERY) if notice else (0, 0))
        asked.clear()
