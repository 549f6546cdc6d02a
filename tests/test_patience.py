"""Stall detection of asynchronous waits (mpicrossbow/rules/patience.py): who is logged, when, and when the
job gives up — with handles that complete when the test says."""

from __future__ import annotations

import logging
import time

import pytest

from mpicrossbow.rules.patience import Patience, Silence, Stalled, wait_for


class LateHandle:
    """A request that completes ``after`` seconds from now."""

    def __init__(self, after: float) -> None:
        self.at = time.monotonic() + after

    def test(self) -> bool:
        return time.monotonic() >= self.at

    def wait(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))


def test_a_silent_peer_is_named_after_warn_after_and_the_wait_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        wait_for(
            {0: LateHandle(0.0), 3: LateHandle(0.35)}, Patience(0.1, 0), "worker rank 1", "for the reply"
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert lines and all(line.endswith("from rank(s) 3") for line in lines)  # rank 0 answered at once
    assert lines[0].startswith("stall: worker rank 1 has waited 0 s for the reply")
    assert 2 <= len(lines) <= 4  # every warn_after, not every poll


def test_a_peer_silent_for_abort_after_ends_the_wait_with_one_line() -> None:
    start = time.monotonic()
    with pytest.raises(Stalled, match=r"from rank\(s\) 2; aborting \(\[watchdog\] abort_after = 0.2 s\)"):
        wait_for({2: LateHandle(60)}, Patience(0, 0.2), "worker rank 1", "for the reply")
    assert time.monotonic() - start < 2


def test_silence_is_timed_per_peer_from_when_it_last_spoke() -> None:
    silence = Silence(Patience(0, 0.2), "parameter server rank 0", "for a push", [1, 2])
    deadline = time.monotonic() + 0.5
    with pytest.raises(Stalled, match=r"from rank\(s\) 2;"):
        while time.monotonic() < deadline:
            silence.heard(1)  # rank 1 keeps pushing; rank 2 never does
            silence.check([1, 2])
            time.sleep(0.01)
    silence.heard(2)
    silence.check([1, 2])  # both heard just now: no stall


def test_ranks_not_waited_on_are_never_a_stall() -> None:
    silence = Silence(Patience(0, 0.05), "parameter server rank 0", "for a push", [1, 2])
    time.sleep(0.1)
    silence.check([])  # e.g. every worker done or waiting for a held reply
    with pytest.raises(Stalled):
        silence.check([2])
