"""Stall detection: when a step takes too long, name the ranks it is waiting for (Horovod's stall check).

Every rank's training loop marks where it is — ``beat(step, "compute")`` when a step starts and
``beat(step, "exchange")`` when its own compute is done and it enters the rule's exchange — which costs two
attribute writes. A daemon thread per rank writes that position to a small heartbeat file in the run folder
every ``interval`` seconds (JSON: rank, host, pid, step, phase, time of the last progress), so it works across
nodes on the shared file system a run folder lives on and needs no MPI from a second thread.

When this rank has not progressed for ``warn_after`` seconds, the thread reads every heartbeat and logs one
warning naming the ranks that have not reached this rank's position (the ranks a collective waits for), or
saying that this rank itself is the one behind. After ``abort_after`` seconds (if set) it reports the stall as
a failure and calls the abort callback, which ends the whole job.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: Order of phases inside a step: a rank in "exchange" of step s is ahead of one in "compute" of step s.
PHASES = {"compute": 0, "exchange": 1, "done": 2}


def heartbeat_file(directory: Path, rank: int) -> Path:
    """The heartbeat file of ``rank`` in ``directory``."""
    return directory / f"rank-{rank:05d}.json"


def read_heartbeats(directory: Path, size: int) -> dict[int, dict]:
    """Every readable heartbeat in ``directory`` (a rank that never wrote one is absent)."""
    beats = {}
    for rank in range(size):
        try:
            beats[rank] = json.loads(heartbeat_file(directory, rank).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return beats


class Watchdog:
    """This rank's heartbeat writer and stall detector (a daemon thread)."""

    def __init__(
        self,
        directory: Path,
        rank: int,
        size: int,
        warn_after: float,
        abort_after: float,
        interval: float,
        abort: Callable[[str], None],
    ) -> None:
        self.directory, self.rank, self.size = directory, rank, size
        self.warn_after, self.abort_after, self.interval = warn_after, abort_after, interval
        self.abort = abort
        self.step, self.phase = 0, "compute"
        self.progressed = time.time()
        self._warned_at: tuple[int, str] | None = None
        self._stop = threading.Event()
        directory.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name=f"watchdog-rank{rank}", daemon=True)

    def start(self) -> Watchdog:
        """Write the first heartbeat and start watching."""
        self._write()
        self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        """The training loop reached ``phase`` of ``step`` (cheap: no I/O here)."""
        self.step, self.phase, self.progressed = step, phase, time.time()

    def stop(self) -> None:
        """Stop the thread and mark this rank done."""
        self.beat(self.step, "done")
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._write()

    def _write(self) -> None:
        beat = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase,
            "progressed": self.progressed,
        }
        path = heartbeat_file(self.directory, self.rank)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(beat), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:  # a full or vanished disk must not kill training
            log.debug("heartbeat not written: %s", exc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()
            if self.phase == "done":
                continue
            stalled = time.time() - self.progressed
            if self.warn_after and stalled >= self.warn_after and self._warned_at != (self.step, self.phase):
                self._warned_at = (self.step, self.phase)
                log.warning("%s", self.describe(stalled))
            if self.abort_after and stalled >= self.abort_after:
                self.abort(
                    f"{self.describe(stalled)}; aborting ([watchdog] abort_after = {self.abort_after:g} s)"
                )
                return

    def describe(self, stalled: float) -> str:
        """One line: how long this rank has been stuck where, and which ranks it is waiting for."""
        mine = (self.step, PHASES[self.phase])
        beats = read_heartbeats(self.directory, self.size)
        behind = []
        for rank in range(self.size):
            if rank == self.rank:
                continue
            beat = beats.get(rank)
            if beat is None:
                behind.append(f"{rank} (no heartbeat)")
            elif (beat["step"], PHASES.get(beat["phase"], 0)) < mine:
                idle = time.time() - beat["progressed"]
                behind.append(
                    f"{rank} on {beat['host']} (pid {beat['pid']}, in {beat['phase']} of step {beat['step']} "
                    f"for {idle:.0f} s)"
                )
        where = f"step {self.step} ({self.phase}) has not progressed for {stalled:.0f} s"
        if behind:
            return f"stall: {where}; waiting for rank(s) {', '.join(behind)}"
        return f"stall: {where}; no other rank is behind: this rank is the one holding the job"
