"""The signal stop's safety net: a rank blocked in a collective still leaves on SIGTERM (scancel, the time
limit) instead of waiting for Slurm's SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

BLOCKED_AFTER_SIGTERM = """
import os, select, signal, sys, time
from mpicrossbow.training.health.signals import SignalStop

class Done:
    def wait(self):
        pass

class OneRank:
    def allreduce(self, tensor, op, async_op=False):
        return Done()

stop = SignalStop(OneRank(), rank=3)
stop(0)
print("ready", flush=True)
select.select([], [], [], 60)  # the main thread blocks (as in a collective whose peer is gone)
sys.exit(9)
"""


def test_a_rank_blocked_after_sigterm_exits_within_the_grace_period() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_AFTER_SIGTERM],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert 4 < time.monotonic() - sent < 10
    assert stderr.startswith(
        "crossbow-launch: error: rank 3: SIGTERM, and the training loop has not come back for 5 s"
    ), stderr


CLOSED_AT_ONCE = """
import time
from mpicrossbow.training.health import signals

class OneRank:
    def allreduce(self, tensor, op, async_op=False):
        raise AssertionError("no check was started")

signals.WATCH_POLL_S = 60.0  # the watch would sleep through the whole test
stop = signals.SignalStop(OneRank())
time.sleep(0.2)  # the watch is in its wait
stop.close()
print("alive" if stop._thread.is_alive() else "ended", flush=True)
"""


def test_close_wakes_the_watch_thread_instead_of_waiting_out_its_poll() -> None:
    """A run's end does not wait for the watch's next look (it did: up to half a second on every rank)."""
    proc = subprocess.run([sys.executable, "-c", CLOSED_AT_ONCE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ended"
