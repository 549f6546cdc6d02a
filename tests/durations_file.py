"""Every test's seconds to a file, for the work on the suite's length (issue 51): set ``XB_DURATIONS`` to a
path and the run writes ``{test id: seconds}`` there as JSON when it ends (setup, call and teardown added up;
a fixture shared by a module's tests is charged to the first that asked for it, as pytest's
``--durations`` does). ``python tests/durations_file.py FILE`` then prints the test files by their total.

    XB_DURATIONS=/tmp/durations.json .venv/bin/python -m pytest -q
    .venv/bin/python tests/durations_file.py /tmp/durations.json
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

#: Seconds per test id, summed over its phases, in this run.
SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add a phase's seconds to its test."""
    SECONDS[report.nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the file ``XB_DURATIONS`` names, when it names one."""
    path = os.environ.get("XB_DURATIONS")
    if path:
        Path(path).write_text(json.dumps(dict(SECONDS), indent=0), encoding="utf-8")


def by_file(seconds: dict[str, float]) -> list[tuple[str, float, int]]:
    """(test file, total seconds, tests) per file, the longest first."""
    totals: dict[str, list[float]] = defaultdict(list)
    for nodeid, value in seconds.items():
        totals[nodeid.split("::", 1)[0]].append(value)
    return sorted(((f, sum(v), len(v)) for f, v in totals.items()), key=lambda row: -row[1])


if __name__ == "__main__":
    rows = by_file(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))
    total = sum(row[1] for row in rows)
    for name, value, count in rows:
        sys.stdout.write(f"{value:8.1f} s {100 * value / total:5.1f} % {count:5d} tests  {name}\n")
    sys.stdout.write(f"{total:8.1f} s in all\n")
