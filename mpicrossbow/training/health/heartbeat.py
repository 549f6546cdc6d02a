"""Heartbeat files: where each rank is, written by its watchdog thread, read by every other rank.

One small JSON file per rank in ``<run>/heartbeats/`` (the run folder lives on a file system every node
sees): rank, host, pid, the kernel and pid namespace the pid belongs to, a sequence number that grows with
every write, and the step and phase the training loop last reported. Writes are atomic (a temporary file
renamed into place), so a reader sees a whole heartbeat or the previous one.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: Order of phases inside a step: a rank in "exchange" of step s is ahead of one in "compute" of step s.
#: "validate" and "save" are work between steps; "done" means the rank finished (its heartbeat stops).
PHASES = {"compute": 0, "exchange": 1, "validate": 2, "save": 2, "done": 3}


def kernel_identity() -> tuple[str, str]:
    """(boot id, pid namespace) of this process: two processes share pids only when both are equal."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return "", ""  # not Linux: pids are never compared across processes
    return boot, namespace


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot); None when it does not exist or is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state is field 3, starttime field 22
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def ended_here(pid: int, started: int, boot: str, pidns: str) -> bool | None:
    """Whether the process (``pid``, its ``started`` time, on kernel ``boot`` in namespace ``pidns``) has
    ended — gone, a zombie, or its pid reused — or None when it cannot be told from here (another kernel,
    another pid namespace, or not Linux)."""
    mine = kernel_identity()
    if not mine[0] or mine != (boot, pidns):
        return None
    return process_start(pid) != started


@dataclass
class Beat:
    """One heartbeat: who wrote it (rank, host, pid, kernel) and where its loop was."""

    rank: int
    host: str
    pid: int
    boot: str = ""
    pidns: str = ""
    #: The process's start time in clock ticks since boot: a pid reused by a new process has another.
    started: int = 0
    #: The job this heartbeat belongs to (a run folder resumed by a later job holds the old job's files).
    job: str = ""
    seq: int = 0
    step: int = 0
    phase: str = "compute"
    #: Wall-clock time (``time.time()``) of the loop's last progress on that rank.
    progressed: float = 0.0
    #: ``[address, port]`` of the rank's link-probe sockets (:mod:`.link_probe`), one per IPv4 address.
    probes: list[list[str | int]] = field(default_factory=list)

    @classmethod
    def mine(cls, rank: int, job: str) -> Beat:
        """A heartbeat for this process in job ``job``."""
        boot, pidns = kernel_identity()
        pid = os.getpid()
        return cls(rank, socket.gethostname(), pid, boot, pidns, started=process_start(pid) or 0, job=job)

    def ended(self) -> bool | None:
        """Whether the process that wrote this heartbeat has ended (None: cannot be told from here)."""
        return ended_here(self.pid, self.started, self.boot, self.pidns)


def heartbeat_file(directory: Path, rank: int) -> Path:
    """The heartbeat file of ``rank`` in ``directory``."""
    return directory / f"rank-{rank:05d}.json"


def fault_file(directory: Path, rank: int) -> Path:
    """Where ``rank``'s Python writes its stack when it dies of a fatal signal (``faulthandler``)."""
    return directory / f"rank-{rank:05d}.fault"


def write_heartbeat(directory: Path, beat: Beat) -> bool:
    """Write ``beat`` atomically; False when the file system refused (the caller decides how loud to be)."""
    path = heartbeat_file(directory, beat.rank)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(asdict(beat)), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("heartbeat not written: %s", exc)
        return False
    return True


def read_heartbeats(directory: Path, size: int, ranks: Iterable[int] | None = None) -> dict[int, Beat]:
    """The readable heartbeats of ``ranks`` (default: all ``size``) in ``directory``; a rank that never wrote
    one is absent."""
    beats = {}
    for rank in range(size) if ranks is None else ranks:
        try:
            raw = json.loads(heartbeat_file(directory, rank).read_text(encoding="utf-8"))
            beats[rank] = Beat(**{k: raw[k] for k in Beat.__dataclass_fields__ if k in raw})
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return beats
