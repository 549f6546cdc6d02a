"""Is every peer still there? A rank killed outright (SIGKILL, the OOM killer, a segfault, a lost node) says
nothing, and under a launcher that does not kill the rest (srun without ``--kill-on-bad-exit``) the others
wait in their next collective until the job's time limit. The watchdog thread asks this module instead.

Two checks, from the peers' heartbeat files (:mod:`.heartbeat`):

* **A peer on this kernel** (same boot, same pid namespace — the same node, emulated nodes included): its pid
  is looked up directly. Gone, a zombie, or reused by another process (other start time) means dead, seen
  within one heartbeat interval. If it died of a fatal signal Python catches (SIGSEGV, SIGBUS, SIGFPE,
  SIGABRT, SIGILL), its ``faulthandler`` file says which.
* **A peer elsewhere**: its heartbeat's sequence number must change; unchanged for ``timeout`` seconds by this
  rank's own clock (no clock skew between nodes matters) means its process or node is gone — or the shared
  file system stopped taking writes, which the message says too.

Each rank watches one peer, the next one in a ring (rank r watches r + 1 mod size): every death is seen by
the nearest living rank before it, exactly once, and the shared file system serves one heartbeat read per
rank and interval rather than one per pair of ranks. A peer that wrote phase ``done`` has finished and is
never reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from .heartbeat import Beat, fault_file


def fatal_signal(directory: Path, rank: int) -> str | None:
    """The first line ``faulthandler`` wrote for ``rank`` (``Fatal Python error: Segmentation fault``)."""
    try:
        text = fault_file(directory, rank).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return text.splitlines()[0] if text else None


class PeerLiveness:
    """Remembers when each peer's heartbeat last changed; names the peers that are gone."""

    def __init__(
        self,
        me: Beat,
        size: int,
        directory: Path,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me, self.size, self.directory, self.timeout, self.clock = me, size, directory, timeout, clock
        #: The peers this rank watches: its successor in the ring (none when alone).
        self.watched = [(me.rank + 1) % size] if size > 1 else []
        self.started = clock()
        #: rank → (sequence number last seen, this rank's clock when it last changed).
        self.seen: dict[int, tuple[int, float]] = {}

    def gone(self, beats: dict[int, Beat]) -> dict[int, str]:
        """Rank → why it is considered dead, for every watched peer that is (empty when all are alive)."""
        now, dead = self.clock(), {}
        for rank in self.watched:
            beat = beats.get(rank)
            if beat is not None and beat.job != self.me.job:
                beat = None  # left in a resumed run folder by an earlier job
            if rank == self.me.rank or (beat is not None and beat.phase == "done"):
                continue
            ended = beat.ended() if beat is not None else None
            if beat is not None and ended is not None:  # a peer on this kernel: its pid says it all
                if ended:
                    dead[rank] = self._died_here(beat)
                continue
            seq = beat.seq if beat is not None else -1
            last = self.seen.get(rank)
            if last is None or last[0] != seq:
                self.seen[rank] = (seq, self.started if last is None and beat is None else now)
                continue
            if self.timeout and now - last[1] >= self.timeout:
                dead[rank] = self._silent(rank, beat, now - last[1])
        return dead

    def _died_here(self, beat: Beat) -> str:
        where = f"rank {beat.rank} on {beat.host} (pid {beat.pid})"
        fatal = fatal_signal(self.directory, beat.rank)
        if fatal:
            return f"{where} died: {fatal} (its stack: {fault_file(self.directory, beat.rank)})"
        return (
            f"{where} is gone: its process ended without reporting an error (killed by SIGKILL — the OOM "
            f"killer, a user or the scheduler — or it exited behind Python's back), last seen in "
            f"{beat.phase} of step {beat.step}"
        )

    def _silent(self, rank: int, beat: Beat | None, silent: float) -> str:
        if beat is None:
            return (
                f"rank {rank} has written no heartbeat to {self.directory} in {silent:.0f} s "
                "(it never started, or its node is gone)"
            )
        return (
            f"rank {rank} on {beat.host} (pid {beat.pid}) has written no heartbeat for {silent:.0f} s, last "
            f"in {beat.phase} of step {beat.step} (its process or node is gone, or the file system under "
            f"{self.directory} stopped taking writes)"
        )
