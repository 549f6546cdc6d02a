"""Stop on SIGTERM/SIGUSR1 (Slurm's warning before the time limit): every rank stops at the same step.

A handler only sets a flag. The ranks agree through one non-blocking 1-value MAX allreduce every
``SIGNAL_CHECK_STEPS`` steps, started at one check and read at the next, so the decision is the same
everywhere and nobody waits for it; the loop then saves a checkpoint and ends, and the job exits with
:data:`~mpicrossbow.errors.STOPPED_EXIT_CODE`.

A rank blocked in a collective (a peer is gone or stuck) never reaches the next check, and Python runs signal
handlers only between bytecodes of the main thread. So the signal is also seen by a small thread through
``signal.set_wakeup_fd`` (written by the C-level handler at once): after SIGTERM — which Slurm follows with
SIGKILL ``KillWait`` seconds later — a rank whose loop has not come back within the grace period says so in
one line and exits with 128 + SIGTERM, instead of ignoring ``scancel`` until the SIGKILL.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from types import FrameType

import torch

from ...comm.base import Communicator, Handle, ReduceOp
from ...launch.failure import say

log = logging.getLogger(__name__)

#: Steps between the ranks' agreements on whether a SIGTERM/SIGUSR1 arrived (the reaction time in steps).
SIGNAL_CHECK_STEPS = 10

#: The signals that ask for a checkpoint and a clean stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

#: After SIGTERM, a loop that has not come back for this many seconds (or 3 × its longest step, up to
#: TERM_GRACE_MAX_S) is stuck: the rank exits without a checkpoint.
TERM_GRACE_S = 5.0
#: The grace never exceeds this: Slurm's default KillWait is 30 s.
TERM_GRACE_MAX_S = 20.0
#: Seconds the watch thread waits for a signal before it looks at the grace again.
WATCH_POLL_S = 0.5


class SignalStop:
    """Installs the handlers; ``stop(step)`` is true on every rank once any rank was signalled. An
    asynchronous run reads :attr:`received` itself (:mod:`.async_checkpoints`) and only calls
    :meth:`touch`."""

    def __init__(self, comm: Communicator, rank: int = 0) -> None:
        self.comm, self.rank = comm, rank
        self.received: int | None = None
        self._flag = torch.zeros(1, dtype=torch.float64)
        self._pending: list[Handle] = []
        self._last_call = time.monotonic()
        self._longest = 0.0
        self._agreed = False
        self._closing = threading.Event()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name=f"signals-rank{rank}", daemon=True)
        self._thread.start()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def touch(self) -> None:
        """The loop came back (a step ended, a server swept its requests): it is not stuck."""
        now = time.monotonic()
        self._longest = max(self._longest, now - self._last_call)
        self._last_call = now

    def agree(self) -> None:
        """Every rank agreed to stop (an asynchronous run's meeting): the grace watch stands down."""
        self._agreed = True

    def __call__(self, step: int) -> bool:
        """Whether to stop after ``step`` (collective every SIGNAL_CHECK_STEPS steps, non-blocking)."""
        self.touch()
        if step % SIGNAL_CHECK_STEPS:
            return False
        if self._pending:
            self._pending.pop().wait()
            if self._flag.item() > 0:
                self._agreed = True
                return True
        self._flag.fill_(1.0 if self.received is not None else 0.0)
        self._pending.append(self.comm.allreduce(self._flag, ReduceOp.MAX, async_op=True))
        return False

    def forget_pending(self) -> None:
        """Elastic training recovered from a lost rank: the check in flight was on the lost world's
        communicator and will never complete; the next check starts afresh over the survivors."""
        self._pending.clear()

    def grace(self) -> float:
        """Seconds a loop may stay away after SIGTERM before the rank counts as stuck."""
        return min(TERM_GRACE_MAX_S, max(TERM_GRACE_S, 3 * self._longest))

    def _watch(self) -> None:
        """Notice SIGTERM even while the main thread is blocked; exit when its loop does not come back."""
        term_at: float | None = None
        while not self._closing.is_set():
            ready, _, _ = select.select([self._read], [], [], WATCH_POLL_S)
            if ready:
                data = os.read(self._read, 64)
                if signal.SIGTERM in data and term_at is None:
                    term_at, self.received = time.monotonic(), signal.SIGTERM
            if term_at is None or self._agreed or self._closing.is_set():
                continue
            away = time.monotonic() - max(self._last_call, term_at)
            if away >= self.grace():
                say(
                    f"rank {self.rank}: SIGTERM, and the training loop has not come back for {away:.0f} s "
                    "(blocked in a collective: a peer is gone or stuck): exiting without a checkpoint"
                )
                os._exit(128 + signal.SIGTERM)

    def close(self) -> None:
        """Complete the last agreement (every rank started it) and restore the default handlers."""
        for handle in self._pending:
            handle.wait()
        self._pending.clear()
        self._closing.set()
        try:  # wake the watch now, not at its next look (up to WATCH_POLL_S at every run's end)
            os.write(self._write, b"\0")
        except BlockingIOError:  # the pipe is full: the watch is awake already
            pass
        self._thread.join(timeout=5)
        signal.set_wakeup_fd(self._previous_fd)
        for fd in (self._read, self._write):
            os.close(fd)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
