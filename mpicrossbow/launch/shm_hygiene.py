"""Remove the shared-memory segments that MPICH (and Open MPI) leave in ``/dev/shm`` when a job fails.

MPICH keeps its own intra-node segment (``/dev/shm/mpich_shm_<hash>_<n>``, about 2 MB, its name derived from
the PMI job name) until ``MPI_Finalize`` unlinks it. A rank that is killed, or a job that ends by
``MPI_Abort`` (every failure does), never gets there: each failed job leaves one segment behind. A node
that runs hundreds of short jobs fills up, and a later job with the same PMI name (a Slurm requeue) finds
the stale file and fails in ``MPI_Init``. mpicrossbow's own window (:mod:`mpicrossbow.comm.shm`) is not
concerned: it is unlinked as soon as every rank has mapped it. Open MPI's shared-memory transport does the
same with ``/dev/shm/sm_segment.<host>.<uid>.<job>.<n>`` (16 MB each): its owner unlinks it at finalize, so
a rank killed in an elastic run (``[elastic] enabled``, where the job goes on and ends well) leaves its
segment.

A segment is removed only when it is this user's and no live process maps it or holds it open: unlinking a
name that a running job still needs (one of its ranks yet to attach in ``MPI_Init``) would break that job.
Two checks, and either one keeps the file:

* ``/proc/<pid>/maps`` and ``/proc/<pid>/fd`` of every live process name the file;
* the kernel refuses a write lease on it (``F_SETLEASE``), which it does while any other open file
  description of it exists, a mapping's included: this sees every process, also those whose ``/proc`` files
  cannot be read (another user's, a more privileged one, another PID namespace sharing ``/dev/shm``).

Where leases are not available (switched off by ``fs.leases-enable``, say), a process whose ``/proc`` files
cannot be read counts as using every segment of the uids it runs as.

Two entries: :func:`removing_new_segments` around a job that ``crossbow-launch`` starts itself (only the
segments created while it ran, once it has ended), and :func:`remove_unused_segments` for
``crossbow-launch --clean-shm`` (every unused segment of this user, for jobs started by an outside
``mpiexec``/``srun``). Only the standard library is imported: the launcher's path stays light.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Where MPICH creates its segments (``shm_open`` names live there on Linux).
DEFAULT_SHM_DIR = Path("/dev/shm")
#: Where the live processes are listed.
PROC_DIR = Path("/proc")
#: The starts of the names of MPICH's and Open MPI's segments.
SEGMENT_PREFIXES = ("mpich_shm_", "sm_segment.")
#: For tests: a folder that stands in for ``/dev/shm`` (unset in real use).
SHM_DIR_VARIABLE = "MPICROSSBOW_SHM_DIR"


@dataclass(frozen=True)
class Segment:
    """One MPI segment file: its name in the shm folder, size in bytes and owner's uid."""

    name: str
    size: int
    uid: int


@dataclass(frozen=True)
class ProcessFiles:
    """What one live process uses of the shm folder: the paths there it maps or holds open.

    ``paths`` is None when the process's maps or fds could not be read; where the kernel's open check cannot
    tell either, it then counts as using every segment owned by one of its ``uids`` (real, effective, saved,
    filesystem).
    """

    pid: int
    uids: frozenset[int]
    paths: frozenset[str] | None


#: Lists the live processes and what they use of a shm folder (resolved path); a parameter for tests.
ProcessReader = Callable[[Path], Iterable[ProcessFiles]]
#: Whether a file is open anywhere else (True), nowhere else (False), or cannot be told (None).
OpenProbe = Callable[[Path], bool | None]


@dataclass(frozen=True)
class Cleanup:
    """The result of one clean-up: the segments removed, their total size, and those kept as in use."""

    removed: tuple[str, ...]
    removed_bytes: int
    in_use: tuple[str, ...]

    def summary(self, folder: Path) -> str:
        """One line for the user: how many segments (and MB) were removed from ``folder``, how many kept."""
        kept = f"; {len(self.in_use)} in use, kept" if self.in_use else ""
        return (
            f"removed {len(self.removed)} MPI shared-memory segment(s), "
            f"{self.removed_bytes / 1e6:.1f} MB, from {folder}{kept}"
        )


def shm_dir(environ: dict[str, str] | None = None) -> Path:
    """The folder holding the segments: ``/dev/shm``, or the folder ``$MPICROSSBOW_SHM_DIR`` names (tests)."""
    environ = dict(os.environ) if environ is None else environ
    return Path(environ.get(SHM_DIR_VARIABLE) or DEFAULT_SHM_DIR)


def list_segments(folder: Path, uid: int | None = None) -> dict[str, Segment]:
    """The MPI segments in ``folder`` that belong to ``uid`` (default: this process's effective uid).

    Only regular files named ``mpich_shm_*`` (MPICH) or ``sm_segment.*`` (Open MPI) count; a folder that
    does not exist has none.
    """
    uid = os.geteuid() if uid is None else uid
    found: dict[str, Segment] = {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return found
    for entry in entries:
        if not entry.name.startswith(SEGMENT_PREFIXES):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:  # removed meanwhile
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
            found[entry.name] = Segment(entry.name, info.st_size, info.st_uid)
    return found


def mapped_paths(maps: str, folder: str) -> set[str]:
    """The paths inside ``folder`` that a ``/proc/<pid>/maps`` text maps.

    A line is ``address perms offset dev inode [path]``; a path that ends in `` (deleted)`` is a file
    already unlinked, not a live name, and does not count.
    """
    prefix = folder.rstrip("/") + "/"
    paths = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(prefix) and not fields[5].endswith(" (deleted)"):
            paths.add(fields[5])
    return paths


def process_uids(status: str) -> frozenset[int]:
    """The uids (real, effective, saved, filesystem) of a ``/proc/<pid>/status`` text."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return frozenset(int(u) for u in line.split()[1:])
    return frozenset()


def open_paths(fd_dir: Path, folder: str) -> set[str]:
    """The paths inside ``folder`` that the open file descriptors in ``fd_dir`` (``/proc/<pid>/fd``) name.

    PermissionError goes to the caller (the process cannot be read); an fd closed meanwhile is skipped.
    """
    prefix = folder.rstrip("/") + "/"
    paths = set()
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except FileNotFoundError:
            continue
        if target.startswith(prefix) and not target.endswith(" (deleted)"):
            paths.add(target)
    return paths


def live_processes(folder: Path, proc: Path = PROC_DIR) -> Iterator[ProcessFiles]:
    """Every live process in ``proc`` with the paths inside ``folder`` it maps or holds open.

    A process that ended while being read is left out (it uses nothing any more); one whose maps or fds
    cannot be read (PermissionError) comes with ``paths=None``.
    """
    where = str(folder)
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        base = Path(entry.path)
        try:
            uids = process_uids((base / "status").read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        paths: frozenset[str] | None
        try:
            maps = (base / "maps").read_text(encoding="utf-8", errors="replace")
            paths = frozenset(mapped_paths(maps, where) | open_paths(base / "fd", where))
        except PermissionError:
            paths = None
        except OSError:  # gone meanwhile (ESRCH, ENOENT)
            continue
        yield ProcessFiles(int(entry.name), uids, paths)


def open_elsewhere(path: Path) -> bool | None:
    """Whether another open file description of ``path`` exists anywhere (a process's fd or mapping): the
    kernel grants a write lease only when there is none. None when leases cannot be used on it.

    The lease is released at once; were the file opened meanwhile, the lease-break signal is SIGURG, which
    is ignored by default (SIGIO, the usual one, would end this process).
    """
    if not hasattr(fcntl, "F_SETLEASE"):  # not Linux
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as exc:
        return True if exc.errno in (errno.EAGAIN, errno.EBUSY) else None
    else:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


def in_use(
    segments: dict[str, Segment],
    folder: Path,
    processes: Iterable[ProcessFiles],
    probe: OpenProbe = open_elsewhere,
) -> set[str]:
    """The names of ``segments`` (in ``folder``) that a live process maps or holds open, or may.

    In use: named in a readable process's maps or fds, or ``probe`` finds it open elsewhere. Where the probe
    cannot tell, a process whose files cannot be read counts as using the segments of its uids.
    """
    used: set[str] = set()
    blind_uids: set[int] = set()
    for process in processes:
        if process.paths is None:
            blind_uids |= process.uids
        else:
            used.update(name for name in segments if str(folder / name) in process.paths)
    for name, seg in segments.items():
        if name not in used:
            verdict = probe(folder / name)
            if verdict or (verdict is None and seg.uid in blind_uids):
                used.add(name)
    return used


def remove_unused(
    segments: dict[str, Segment],
    folder: Path,
    processes: ProcessReader = live_processes,
    probe: OpenProbe = open_elsewhere,
) -> Cleanup:
    """Unlink those of ``segments`` in ``folder`` that no live process uses (:func:`in_use`); return what
    was done.

    A segment that vanished meanwhile (its job finished and unlinked it) is not counted; one that cannot be
    unlinked is logged and kept.
    """
    if not segments:
        return Cleanup((), 0, ())
    resolved = Path(os.path.realpath(folder))
    used = in_use(segments, resolved, processes(resolved), probe)
    removed: list[str] = []
    size = 0
    for name in sorted(set(segments) - used):
        try:
            os.unlink(folder / name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove %s: %s", folder / name, exc.strerror or exc)
            continue
        removed.append(name)
        size += segments[name].size
    return Cleanup(tuple(removed), size, tuple(sorted(used)))


def remove_unused_segments(
    folder: Path | None = None, processes: ProcessReader = live_processes, probe: OpenProbe = open_elsewhere
) -> Cleanup:
    """``crossbow-launch --clean-shm``: unlink every MPI segment of this user that no live process uses."""
    folder = shm_dir() if folder is None else folder
    done = remove_unused(list_segments(folder), folder, processes, probe)
    log.debug("removed from %s: %s", folder, ", ".join(done.removed) or "nothing")
    return done


@contextmanager
def removing_new_segments(
    folder: Path | None = None, processes: ProcessReader = live_processes, probe: OpenProbe = open_elsewhere
) -> Iterator[None]:
    """Around a job that ``crossbow-launch`` starts itself: once the block ends (the job has ended, however),
    unlink the MPI segments of this user created meanwhile that no live process uses.

    Segments that existed before are left alone (another job's, or one for ``--clean-shm``); new ones
    still used belong to a job started beside this one and are kept too. The count and size removed are
    logged.
    """
    folder = shm_dir() if folder is None else folder
    before = set(list_segments(folder))
    try:
        yield
    finally:
        new = {n: s for n, s in list_segments(folder).items() if n not in before}
        done = remove_unused(new, folder, processes, probe)
        if done.removed:
            log.info(
                "removed %d shared-memory segment(s) (%.1f MB) that the job's MPI left in %s",
                len(done.removed),
                done.removed_bytes / 1e6,
                folder,
            )
        log.debug("new segments: %d, removed: %s", len(new), ", ".join(done.removed) or "none")
