"""The watchdog: a daemon thread per rank that keeps its heartbeat, notices dead peers and stalled steps.

Every rank's training loop marks where it is — ``beat(step, "compute")`` when a step starts,
``beat(step, "exchange")`` when its own compute is done and it enters the rule's exchange, ``validate`` and
``save`` for the work between steps — which costs three attribute writes. Every ``interval`` seconds the
thread

1. writes this rank's heartbeat (:mod:`.heartbeat`): it needs no MPI from a second thread and works across
   nodes on the shared file system a run folder lives on;
2. asks :mod:`.liveness` whether the peer it watches (the next rank in a ring) is still there. A dead
   peer ends the job within seconds on its node (pid check) and within ``peer_timeout`` elsewhere: the rank
   before it prints one line naming the dead rank, its host and how it died, and aborts. A peer on another
   node is also pinged over the network (:mod:`.link_probe`): silent for ``peer_timeout`` while its
   heartbeat goes on, the network between the two hosts is gone, and the watcher says so and aborts;
3. (synchronous rules) when this rank's step has not progressed for ``warn_after`` seconds, logs one warning
   naming the ranks that have not reached its position (the ranks a collective waits for), or saying that
   this rank itself is the one behind; after ``abort_after`` seconds it aborts the job. ``abort_after =
   auto`` waits ``AUTO_FACTOR`` × the longest step seen so far, at least ``AUTO_FLOOR_S`` (the first step,
   which compiles and warms up, gets ``AUTO_FIRST_STEP_S``), and only inside steps: validation and
   checkpoints are not timed.
"""

from __future__ import annotations

import faulthandler
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Literal

from ...config import WatchdogSection
from ...launch.failure import abort_job
from ...launch.world import World
from .heartbeat import PHASES, Beat, fault_file, read_heartbeats, write_heartbeat
from .link_probe import LinkProbe
from .liveness import PeerLiveness

log = logging.getLogger(__name__)

#: ``abort_after = auto``: a step may take this many times the longest step seen so far ...
AUTO_FACTOR = 10.0
#: ... but never less than this many seconds ...
AUTO_FLOOR_S = 600.0
#: ... and the first step (compilation, cuDNN autotuning, data loader start) this many.
AUTO_FIRST_STEP_S = 1800.0
#: Phases inside a step: stall warnings and ``abort_after = auto`` apply only there.
STEP_PHASES = ("compute", "exchange")


class Watchdog:
    """This rank's heartbeat writer, dead-peer detector and stall detector (a daemon thread).

    ``abort(line, peer_gone)`` ends the job: ``line`` is the one line to print, ``peer_gone`` tells a dead
    peer (whose own death the launcher reports) from a stall.
    """

    def __init__(
        self,
        directory: Path,
        rank: int,
        size: int,
        warn_after: float,
        abort_after: float | Literal["auto"],
        interval: float,
        abort: Callable[[str, bool], None],
        peer_timeout: float = 0.0,
        stalls: bool = True,
        job: str = "",
        peers: bool = True,
    ) -> None:
        self.directory, self.rank, self.size = directory, rank, size
        self.warn_after, self.abort_after, self.interval = warn_after, abort_after, interval
        self.abort, self.stalls, self.peer_timeout = abort, stalls, peer_timeout
        self.me = Beat.mine(rank, job)
        self.step, self.phase = 0, "compute"
        self.progressed = time.time()
        #: The longest step seen so far (seconds from one step's start to the next one's).
        self.longest = 0.0
        self._step_started: float | None = None
        self._warned_at: tuple[int, str] | None = None
        self._fault_file: IO[str] | None = None
        self._faulthandler_was_on = False
        self._stop = threading.Event()
        directory.mkdir(parents=True, exist_ok=True)
        # Elastic training (``peers`` False) goes on without a dead peer: ULFM reports it, nobody aborts.
        self.liveness = PeerLiveness(self.me, size if peers else 1, directory, peer_timeout)
        self.probe = LinkProbe(job, peer_timeout) if peer_timeout and size > 1 else None
        if self.probe is not None:
            self.me.probes = self.probe.endpoints()
        self._thread = threading.Thread(target=self._loop, name=f"watchdog-rank{rank}", daemon=True)

    def start(self) -> Watchdog:
        """Write the first heartbeat, route fatal-signal stacks to this rank's fault file, start watching."""
        self._faulthandler_was_on = faulthandler.is_enabled()
        try:
            self._fault_file = fault_file(self.directory, self.rank).open("w", encoding="utf-8")
            faulthandler.enable(self._fault_file)
        except OSError as exc:
            log.debug("no fault file: %s", exc)
        self._write()
        self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        """The training loop reached ``phase`` of ``step`` (cheap: no I/O here)."""
        now = time.time()
        if phase == "compute":
            if self._step_started is not None and self.phase == "exchange":
                self.longest = max(self.longest, now - self._step_started)
            self._step_started = now
        self.step, self.phase, self.progressed = step, phase, now

    def stop(self) -> None:
        """Stop the thread and mark this rank done."""
        self.beat(self.step, "done")
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._write()
        if self.probe is not None:
            self.probe.close()
        if self._fault_file is not None:
            faulthandler.disable()
            if self._faulthandler_was_on:  # as the user had it (PYTHONFAULTHANDLER, -X faulthandler)
                faulthandler.enable()
            self._fault_file.close()
            fault_file(self.directory, self.rank).unlink(missing_ok=True)

    def _write(self) -> None:
        me = self.me
        me.seq, me.step, me.phase, me.progressed = me.seq + 1, self.step, self.phase, self.progressed
        write_heartbeat(self.directory, me)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()
            if self.phase == "done":
                continue
            if self._check_peers():
                return
            if self.stalls and self._check_stall():
                return

    def _check_peers(self) -> bool:
        """Abort when the watched peer is gone."""
        watched = read_heartbeats(self.directory, self.size, self.liveness.watched)
        dead = self.liveness.gone(watched)
        if not dead and self.probe is not None:
            peer = self.liveness.watched[0]
            cut = self.probe.tick(self.me, watched.get(peer))
            dead = {peer: cut} if cut else {}
        if not dead:
            return False
        reasons = "; ".join(dead[r] for r in sorted(dead))
        self.abort(f"{reasons}; rank {self.rank} aborts the job", True)
        return True

    def limit(self) -> float:
        """Seconds without progress after which this rank aborts the job now (0: never)."""
        if self.abort_after != "auto":
            return float(self.abort_after)
        if self.phase not in STEP_PHASES:
            return 0.0
        if self.longest == 0.0:
            return AUTO_FIRST_STEP_S
        return max(AUTO_FLOOR_S, AUTO_FACTOR * self.longest)

    def _check_stall(self) -> bool:
        stalled = time.time() - self.progressed
        in_step = self.phase in STEP_PHASES
        if (
            in_step
            and self.warn_after
            and stalled >= self.warn_after
            and self._warned_at
            != (
                self.step,
                self.phase,
            )
        ):
            self._warned_at = (self.step, self.phase)
            log.warning("%s", self.describe(stalled))
        limit = self.limit()
        if limit and stalled >= limit:
            setting = f"auto: {limit:g} s" if self.abort_after == "auto" else f"{limit:g} s"
            self.abort(
                f"rank {self.rank} of {self.size} on {self.me.host}: {self.describe(stalled)}; "
                f"aborting ([watchdog] abort_after = {setting})",
                False,
            )
            return True
        return False

    def describe(self, stalled: float) -> str:
        """One line: how long this rank has been stuck where, and which ranks it is waiting for (reads every
        heartbeat: only once a step is late)."""
        beats = read_heartbeats(self.directory, self.size)
        mine = (self.step, PHASES[self.phase])
        behind = []
        for rank in range(self.size):
            if rank == self.rank:
                continue
            beat = beats.get(rank)
            if beat is None or beat.job != self.me.job:
                behind.append(f"{rank} (no heartbeat)")
            elif (beat.step, PHASES.get(beat.phase, 0)) < mine:
                idle = time.time() - beat.progressed
                behind.append(
                    f"{rank} on {beat.host} (pid {beat.pid}, in {beat.phase} of step {beat.step} "
                    f"for {idle:.0f} s)"
                )
        where = f"step {self.step} ({self.phase}) has not progressed for {stalled:.0f} s"
        longest = f" (longest step so far: {self.longest:.2g} s)" if self.longest else ""
        if behind:
            return f"stall: {where}; waiting for rank(s) {', '.join(behind)}{longest}"
        return f"stall: {where}; no other rank is behind: this rank is the one holding the job{longest}"


def start_watchdog(
    section: WatchdogSection, world: World, run_dir: Path, synchronous: bool, elastic: bool
) -> Watchdog:
    """The session's watchdog, started (collective: the job's token is broadcast): heartbeats in
    ``<run>/heartbeats``; a dead peer, or a stall past ``abort_after``, aborts the job. Stalls are timed only
    for ``synchronous`` rules (asynchronous ranks have no common step); an ``elastic`` run watches no peers
    (ULFM reports a dead one, and the survivors go on)."""
    job = world.bcast(secrets.token_hex(8))  # this job's heartbeats, not those a resumed folder holds
    return Watchdog(
        run_dir / "heartbeats",
        world.rank,
        world.size,
        section.warn_after,
        section.abort_after,
        section.interval,
        # Recorded also for a dead peer (status 1, a failed rank): the sbatch templates stop waiting for
        # srun once a status is written, and srun waits half a minute for a node that is gone.
        lambda line, peer_gone: abort_job(world, line),
        peer_timeout=0.0 if elastic else section.peer_timeout,
        peers=not elastic,
        stalls=synchronous,
        job=job,
    ).start()
