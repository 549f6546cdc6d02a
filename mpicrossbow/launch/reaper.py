"""A job ends when its last process does, not when its launcher returns.

MPICH's ``mpiexec`` returns from a failed job (``MPI_Abort``, a killed rank) while its proxy and the ranks
are still being torn down: for a moment they still run and map the job's shared memory. ``crossbow-launch``
makes itself a child subreaper (Linux's ``PR_SET_CHILD_SUBREAPER``) while the job runs, so the processes that
``mpiexec`` leaves behind become its children; after ``mpiexec`` has returned it waits (bounded) until they
have exited and reaps them. What runs after the job (:mod:`~mpicrossbow.launch.shm_hygiene`) then sees the
job's files as nobody's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

#: ``prctl`` option of ``<linux/prctl.h>``: orphaned descendants are re-parented to this process.
PR_SET_CHILD_SUBREAPER = 36
#: Seconds to wait for the processes a job left behind once its launcher has returned.
ORPHAN_WAIT_S = 10.0
#: Seconds between two looks at them.
POLL_S = 0.02


def set_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (or stop being one); False where the system does not allow it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def children(proc: Path = Path("/proc")) -> dict[int, str]:
    """This process's children and their state letters (``Z``: exited, not yet reaped), from ``/proc``."""
    me = os.getpid()
    found: dict[int, str] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:  # ended meanwhile
            continue
        state, ppid = text.rpartition(")")[2].split()[:2]  # the command name may hold spaces and ")"
        if int(ppid) == me:
            found[int(entry.name)] = state
    return found


def reaped(pid: int) -> bool:
    """Reap the exited child ``pid`` if it can be; False while it is not done (a zombie leader whose other
    threads still run, and who still holds the memory, reads ``Z`` too)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # not a child (any more)
        return True


def wait_for_orphans(
    ignore: set[int],
    timeout: float = ORPHAN_WAIT_S,
    list_children: Callable[[], dict[int, str]] = children,
) -> list[int]:
    """Wait up to ``timeout`` seconds until this process has no children left but ``ignore``, reaping them
    as they exit. Returns those still running at the deadline.

    Only a look that finds no child at all ends the wait: a child that exits hands its own children to this
    process, so after reaping one the next look may find more.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = {pid: state for pid, state in list_children().items() if pid not in ignore}
        if not found:
            return []
        running = [pid for pid, state in found.items() if not (state == "Z" and reaped(pid))]
        if running and time.monotonic() >= deadline:
            return running
        if running:
            time.sleep(POLL_S)


@contextmanager
def awaiting_orphans(timeout: float = ORPHAN_WAIT_S) -> Iterator[None]:
    """Around starting and waiting for a job: adopt what its launcher leaves behind, and when the block ends
    wait (up to ``timeout`` s) until those processes have exited too. Nothing is waited for where this
    process cannot be a subreaper."""
    before = set(children())
    if not set_subreaper(True):
        yield
        return
    try:
        yield
    finally:
        try:
            left = wait_for_orphans(before, timeout)
            if left:
                log.warning(
                    "%d process(es) of the job still running %.0f s after it ended: %s",
                    len(left),
                    timeout,
                    ", ".join(map(str, left)),
                )
        finally:
            set_subreaper(False)
