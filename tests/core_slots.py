"""The machine's cores as slots that the suite's MPI jobs take before they start (issue 51: a green suite).

On two pytest workers (tests/parallel.py) two ``mpiexec`` jobs could run at once on the CI machine's two
cores, and MPICH's ranks poll flat out while they wait: a job of 4 ranks beside one of 2 left each rank a
third of a core, and the job whose ranks give their core back while they wait (node-shared memory's
backoff) lost most. Measured here (``pytest -n 2`` on test_parameter_server.py and test_pipeline_mpi.py):
the MNIST-1D job took 38 s beside the parameter-server jobs and 10 s alone; on the CI machine it ran past
its 300 s timeout. Two CPU-bound jobs on two cores never finish sooner together than one after the other.

So :func:`cores_for` holds ``min(ranks, cores)`` of the machine's cores, one lock file each, for as long
as a job runs: on two cores one job at a time, on sixteen several. The locks are ``flock`` locks (the
kernel drops them when a worker dies; their descriptors are not inherited, so a job's stray rank never
keeps them); every pytest process on the machine shares them, so two sessions also take turns. A process
already holding slots takes none again (a test's second job, started while its first runs, may depend on
it). The daemons' group (Slurm, namespace nodes: mostly waiting) and the in-process tests take no slots and
keep running beside the jobs (conftest's ``mpi_tests_take_the_cores``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

#: The folder of the slots' lock files (one per core; shared by every pytest process on the machine).
SLOTS_DIR = Path(tempfile.gettempdir()) / "mpicrossbow-test-cores"
#: Seconds between two tries to take the slots a job needs.
RETRY_S = 0.05

_guard = threading.Lock()
_held: list[int] = []  # this process's slot files (open descriptors)
_users = 0  # this process's jobs now running on those slots
#: Seconds this process has waited for slots so far (tests/durations_file.py charges each test its part, so
#: a test's own time is its wall less what it waited for the other worker's job).
waited_s = 0.0


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def _try_take(wanted: int) -> list[int] | None:
    """``wanted`` slots' descriptors, locked, or None (nothing kept) when fewer are free now."""
    SLOTS_DIR.mkdir(exist_ok=True)
    taken: list[int] = []
    for slot in range(cores()):
        fd = os.open(SLOTS_DIR / f"{slot}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        taken.append(fd)
        if len(taken) == wanted:
            return taken
    for fd in taken:
        os.close(fd)  # closing drops the lock
    return None


@contextlib.contextmanager
def cores_for(ranks: int | None = None) -> Iterator[None]:
    """Hold ``min(ranks, cores)`` of the machine's cores (all of them when ``ranks`` is None) while the
    block runs: waits until they are free; a process holding slots already goes straight on."""
    global _users, waited_s
    with _guard:
        wanted = cores() if ranks is None else max(1, min(ranks, cores()))
        asked = time.monotonic()
        while not _held:
            taken = _try_take(wanted)
            if taken is None:
                time.sleep(RETRY_S)
            else:
                _held.extend(taken)
        waited_s += time.monotonic() - asked
        _users += 1
    try:
        yield
    finally:
        with _guard:
            _users -= 1
            if _users == 0:
                while _held:
                    os.close(_held.pop())
