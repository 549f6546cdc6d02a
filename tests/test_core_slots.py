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
from pathlib import Path
sys.path.insert(0, {tests!r})
import core_slots
core_slots.SLOTS_DIR, ranks, me, other = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
with core_slots.cores_for(ranks):
    start = time.monotonic()
    (core_slots.SLOTS_DIR / me).touch()
    if other == "-":
        time.sleep(0.5)
        print(start, time.monotonic())
    else:  # wait, holding the cores, until the other job holds its own: both must get there
        deadline = time.monotonic() + 20
        while not (core_slots.SLOTS_DIR / other).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("met" if (core_slots.SLOTS_DIR / other).exists() else "alone")
"""


def holders(slots: Path, ranks: int, jobs: int, meet: bool) -> list[str]:
    """Start ``jobs`` processes at once, each holding cores for ``ranks`` ranks: for 0.5 s (``meet``
    false; each prints when it held), or until the other one holds its own (two jobs; each prints whether
    they met). Their outputs."""
    code = HOLDER.format(tests=str(Path(__file__).parent))
    names = [f"job{i}" for i in range(jobs)]
    others = [names[1 - i] if meet else "-" for i in range(jobs)]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(slots), str(ranks), name, other],
                         stdout=subprocess.PIPE, text=True)
        for name, other in zip(names, others, strict=True)
    ]  # fmt: skip
    out = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), out
    return out


def test_jobs_wanting_every_core_run_one_after_the_other(tmp_path: Path) -> None:
    held = sorted(tuple(map(float, o.split())) for o in holders(tmp_path, core_slots.cores(), 3, meet=False))
    for (_, end), (start, _) in itertools.pairwise(held):
        assert start >= end, held


@pytest.mark.skipif(core_slots.cores() < 2, reason="needs two cores")
def test_jobs_that_fit_side_by_side_run_at_once(tmp_path: Path) -> None:
    assert holders(tmp_path, 1, 2, meet=True) == ["met\n", "met\n"], "two one-rank jobs waited for each other"


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
