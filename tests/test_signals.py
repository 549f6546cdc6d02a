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
