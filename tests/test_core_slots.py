"""tests/core_slots.py: the suite's MPI jobs take the machine's cores in turn, never two at once on a
machine too small for both, and a test's second job never waits for its own first."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import core_slots

pytestmark = pytest.mark.quick

HOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
import core_slots
core_slots.SLOTS_DIR = __import__("pathlib").Path(sys.argv[1])
with core_slots.cores_for(int(sys.argv[2])):
    start = time.monotonic()
    time.sleep(0.5)
    print(start, time.monotonic())
"""


def held_intervals(slots: Path, ranks: int, jobs: int) -> list[tuple[float, float]]:
    """Start ``jobs`` processes at once, each holding cores for ``ranks`` ranks for 0.5 s: when each held."""
    code = HOLDER.format(tests=str(Path(__file__).parent))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(slots), str(ranks)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(jobs)
    ]
    out = [p.communicate(timeout=30)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), out
    return sorted(tuple(map(float, o.split())) for o in out)  # type: ignore[misc]


def test_jobs_wanting_every_core_run_one_after_the_other(tmp_path: Path) -> None:
    held = held_intervals(tmp_path, ranks=core_slots.cores(), jobs=3)
    for (_, end), (start, _) in itertools.pairwise(held):
        assert start >= end, held


@pytest.mark.skipif(core_slots.cores() < 2, reason="needs two cores")
def test_jobs_that_fit_side_by_side_run_at_once(tmp_path: Path) -> None:
    (_, a_end), (b_start, _) = held_intervals(tmp_path, ranks=1, jobs=2)
    assert b_start < a_end, "two one-rank jobs on two free cores waited for each other"


def test_a_process_holding_cores_starts_its_next_job_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test's second job (a thread of the same process) may need its first: it must not wait for it."""
    monkeypatch.setattr(core_slots, "SLOTS_DIR", tmp_path)
    inner_ran = threading.Event()

    def second_job() -> None:
        with core_slots.cores_for(core_slots.cores()):
            inner_ran.set()

    with core_slots.cores_for(core_slots.cores()):
        thread = threading.Thread(target=second_job, daemon=True)
        thread.start()
        assert inner_ran.wait(5.0), "the second job waited for the cores its own process holds"
    thread.join(5.0)
    with core_slots.cores_for(1):  # all given back: taking them again does not wait
        assert len(core_slots._held) == 1
    assert core_slots._held == []
    assert len(list(tmp_path.glob("*.lock"))) == core_slots.cores()
