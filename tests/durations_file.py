"""Every test's seconds to a file, for the work on the suite's length (issue 51): set ``XB_DURATIONS`` to a
path and the run writes ``{test id: [wall seconds, CPU seconds]}`` there as JSON when it ends. Wall: setup,
call and teardown added up (a fixture shared by a module's tests is charged to the first that asked for it,
as pytest's ``--durations`` does). CPU: the whole machine's busy seconds while the test ran, from
/proc/stat (so the ranks that Slurm's or a namespace node's daemons start count too; run on an otherwise
idle machine), else this process's and its waited-for children's. A test whose CPU is far below its wall
times the cores mostly waits (sleeps, timeouts): shortening those waits, not the work, shortens it.
Each test's seconds waiting for core slots (:mod:`core_slots`: the other worker's MPI job) are kept too, and
``python tests/durations_file.py FILE`` prints the test files by their own seconds (wall less those waits:
what the file costs the suite), with their wall and CPU. Each test
also keeps when it started and ended (seconds since the epoch) and on which worker, so ``--overlap TEXT``
prints, for every test whose id holds TEXT, what the other worker ran meanwhile (a test slow only in the
full suite: what was beside it).

    XB_DURATIONS=/tmp/durations.json .venv/bin/python -m pytest -q
    .venv/bin/python tests/durations_file.py /tmp/durations.json [--overlap test_parameter_server.py::]
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import core_slots

#: [wall seconds, CPU seconds, start, end (seconds since the epoch), worker, seconds waited for core slots]
#: per test id, in this run.
SECONDS: dict[str, list[float | str]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, "", 0.0])


def _cpu_seconds() -> float:
    """The machine's busy CPU seconds so far (every core's time not idle nor waiting for I/O, /proc/stat),
    else user + system seconds of this process and of its waited-for children."""
    try:
        fields = Path("/proc/stat").read_text(encoding="ascii").split("\n", 1)[0].split()[1:]
    except OSError:
        times = os.times()
        return times.user + times.system + times.children_user + times.children_system
    ticks = [int(f) for f in fields]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Charge the CPU seconds spent while ``item`` ran (its setup, call and teardown) to it."""
    started, since, waited = _cpu_seconds(), time.time(), core_slots.waited_s
    yield
    row = SECONDS[item.nodeid]
    row[1] = float(row[1]) + _cpu_seconds() - started
    worker = str(getattr(item.config, "workerinput", {}).get("workerid", ""))
    row[2:] = [since, time.time(), worker, core_slots.waited_s - waited]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add a phase's wall seconds to its test."""
    row = SECONDS[report.nodeid]
    row[0] = float(row[0]) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the file ``XB_DURATIONS`` names, when it names one. On several workers (tests/parallel.py) each
    worker writes ``<file>.<worker>`` and the controller, which ends last, merges them into the file (a
    worker's CPU seconds then hold the other worker's tests too: time a serial run for the CPU column)."""
    path = os.environ.get("XB_DURATIONS")
    if not path:
        return
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if worker is not None:
        Path(f"{path}.{worker}").write_text(json.dumps(dict(SECONDS), indent=0), encoding="utf-8")
        return
    merged = dict(SECONDS)
    for part in sorted(Path(path).parent.glob(f"{Path(path).name}.gw*")):
        merged.update(json.loads(part.read_text(encoding="utf-8")))
        part.unlink()
    Path(path).write_text(json.dumps(merged, indent=0), encoding="utf-8")


def own_seconds(value: list[float | str] | float) -> float:
    """A test's own seconds: its wall less what it waited for core slots (the other worker's job)."""
    if not isinstance(value, list):
        return float(value)
    return float(value[0]) - (float(value[5]) if len(value) >= 6 else 0.0)


def by_file(seconds: dict[str, list[float]]) -> list[tuple[str, float, float, int, float]]:
    """(test file, wall seconds, CPU seconds, tests, own seconds) per file, the longest wall first."""
    totals: dict[str, list[list[float]]] = defaultdict(list)
    for nodeid, value in seconds.items():
        totals[nodeid.split("::", 1)[0]].append(value if isinstance(value, list) else [value, float("nan")])
    rows = [
        (f, sum(v[0] for v in vs), sum(v[1] for v in vs), len(vs), sum(own_seconds(v) for v in vs))
        for f, vs in totals.items()
    ]
    return sorted(rows, key=lambda row: -row[1])


def overlapping(seconds: dict[str, list], text: str) -> list[tuple[str, list[tuple[str, float]]]]:
    """For each test whose id holds ``text`` (the longest first), the tests another worker ran while it
    ran, with the seconds they overlapped, the longest first (files written before the spans were kept
    have none)."""
    spans = {k: v for k, v in seconds.items() if isinstance(v, list) and len(v) >= 5}
    out = []
    for nodeid, (_wall, _, start, end, worker, *_) in sorted(spans.items(), key=lambda kv: -kv[1][0]):
        if text not in nodeid:
            continue
        beside = [
            (other, min(end, o_end) - max(start, o_start))
            for other, (_, _, o_start, o_end, o_worker, *_) in spans.items()
            if o_worker != worker and min(end, o_end) > max(start, o_start)
        ]
        out.append((nodeid, sorted(beside, key=lambda b: -b[1])))
    return out


if __name__ == "__main__":
    table = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    if len(sys.argv) == 4 and sys.argv[2] == "--overlap":
        for nodeid, beside in overlapping(table, sys.argv[3]):
            sys.stdout.write(f"{table[nodeid][0]:7.1f} s  {nodeid}\n")
            for other, seconds in beside[:5]:
                sys.stdout.write(f"          {seconds:7.1f} s beside  {other}\n")
        sys.exit(0)
    rows = by_file(table)
    total = sum(row[1] for row in rows)
    for name, wall, cpu, count, own in sorted(rows, key=lambda row: -row[4]):
        sys.stdout.write(f"{own:8.1f} s own {wall:8.1f} s wall  CPU {cpu:8.1f} s {count:5d} tests  {name}\n")
    own_total = sum(row[4] for row in rows)
    sys.stdout.write(
        f"{own_total:8.1f} s own, {total:8.1f} s wall in all, CPU {sum(row[2] for row in rows):.1f} s\n"
    )
