"""PeerWatch: whether a rank's node peers and its launcher are still there, for loops that wait on memory.

A rank that polls node-shared memory for its peers' flags (:mod:`.shm`) makes no MPI call the library could
fail, so nothing ends the wait when a peer dies or the job ends around it. Under ``mpiexec --with-ft ulfm``
without elastic training a SIGKILLed rank left its node peers spinning in that poll at 65 % of a core after
mpiexec had exited: ULFM's runtime does not end the survivors on ``MPI_Abort`` the way a plain job does, and
the orphans were re-parented to init. The poll asks this watch, rarely, whether to go on:

* **the job ended**: this process's parent (the launcher's daemon: prted, hydra's proxy, slurmstepd) is not
  the one it had at start, so the process was re-parented: the launcher is gone;
* **a peer died**: a node peer's process is gone or a zombie. A peer is known by its pid *and* its start
  time (``/proc/<pid>/stat`` field 22), which every node rank reported at start and which were checked
  then: where a peer's pid means another process here (ranks in other pid namespaces), the watch does not
  judge that peer, so it never stops a healthy job.

Either ends the wait with :class:`PeerGone`, which goes through the failure protocol (one line naming the
rank and why, then the job ends). Checks are cheap (one ``getppid`` and a ``stat`` read per peer) and
happen only after :data:`QUIET_S` of waiting, then every :data:`EVERY_S`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: Seconds a wait goes on before the first check: a step's ordinary wait never pays for one.
QUIET_S = 1.0
#: Seconds between checks after that.
EVERY_S = 0.5


class PeerGone(RuntimeError):
    """A wait on node-shared memory cannot end: a peer it waits for is dead, or the job ended around it."""


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), None when it is
    gone; a zombie counts as gone (it will never write to the window again)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


class PeerWatch:
    """Judges, from this process, whether the node peers a wait depends on can still answer.

    ``peers`` maps a node rank to the ``(pid, start time)`` that rank reported at start (this rank's own
    entry included, and skipped). Built once per communicator; :meth:`waiting` is called from the poll loop.
    """

    def __init__(self, me: int, peers: dict[int, tuple[int, int | None]]) -> None:
        self.me = me
        self.parent = os.getppid()
        # a peer whose pid shows another process here (another pid namespace) is not judged
        self.peers = {
            q: (pid, started)
            for q, (pid, started) in peers.items()
            if q != me and started is not None and start_time(pid) == started
        }
        unjudged = sorted(set(peers) - set(self.peers) - {me})
        if unjudged:
            log.debug(
                "node rank(s) %s are not visible from here by pid: their deaths are not watched", unjudged
            )
        self._waiting_since: float | None = None
        self._next = 0.0

    @staticmethod
    def mine() -> tuple[int, int | None]:
        """What this process reports to its peers: its pid and start time."""
        pid = os.getpid()
        return pid, start_time(pid)

    def reset(self) -> None:
        """A wait ended: the next one starts quiet again."""
        self._waiting_since = None

    def waiting(self, what: str) -> None:
        """Called while a wait goes on (cheap: reads the clock): after :data:`QUIET_S`, every
        :data:`EVERY_S`, raise :class:`PeerGone` when the job ended or a peer died."""
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since, self._next = now, now + QUIET_S
            return
        if now < self._next:
            return
        self._next = now + EVERY_S
        self.check(what, now - self._waiting_since)

    def check(self, what: str, waited: float = 0.0) -> None:
        """Raise :class:`PeerGone` when this process was re-parented (its launcher is gone) or a watched
        peer's process is gone; ``what`` names the wait in the message."""
        if os.getppid() != self.parent:
            raise PeerGone(
                f"the job ended around this rank: its launcher (pid {self.parent}) is gone, after "
                f"{waited:.1f} s waiting in {what}"
            )
        for q, (pid, started) in self.peers.items():
            if start_time(pid) != started:
                raise PeerGone(
                    f"node rank {q} (pid {pid}) is gone, after {waited:.1f} s waiting for it in {what}"
                )
