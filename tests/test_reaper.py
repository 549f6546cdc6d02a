"""The launcher returns once its job's last process has ended: what ``mpiexec`` leaves behind is adopted
(child subreaper), waited for and reaped."""

from __future__ import annotations

import subprocess
import time

import pytest

from mpicrossbow.launch import reaper
from mpicrossbow.launch.reaper import awaiting_orphans, children, set_subreaper, wait_for_orphans


def test_orphans_of_the_job_are_waited_for_and_reaped() -> None:
    if not set_subreaper(False):
        pytest.skip("this system has no child subreapers")
    started = time.monotonic()
    with awaiting_orphans(timeout=20):
        # The shell exits at once, as mpiexec does, and leaves its child running.
        shell = subprocess.Popen(["sh", "-c", "sleep 0.5 & echo $!"], stdout=subprocess.PIPE, text=True)
        orphan = int(shell.communicate(timeout=20)[0])
    assert time.monotonic() - started >= 0.45
    assert orphan not in children()


def test_children_from_before_are_not_waited_for() -> None:
    if not set_subreaper(False):
        pytest.skip("this system has no child subreapers")
    before = subprocess.Popen(["sleep", "5"])
    try:
        started = time.monotonic()
        with awaiting_orphans(timeout=20):
            pass
        assert time.monotonic() - started < 2 and before.poll() is None
    finally:
        before.kill()
        before.wait(10)


def test_the_wait_looks_again_after_reaping_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    looks = iter([{7: "Z", 8: "S"}, {9: "S", 8: "S"}, {9: "Z"}, {}])
    reaped: list[int] = []
    monkeypatch.setattr(reaper, "reaped", lambda pid: reaped.append(pid) or True)
    monkeypatch.setattr(reaper, "POLL_S", 0.0)
    assert wait_for_orphans({8}, timeout=20, list_children=lambda: next(looks)) == []
    assert reaped == [7, 9]
    still = wait_for_orphans(set(), timeout=0.05, list_children=lambda: {5: "R"})
    assert still == [5]
