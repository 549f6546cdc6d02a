"""Stalls of asynchronous rules under real ``mpiexec``: a hung worker (``[inject] action = hang``) is named by
the parameter server and by the worker whose held reply waits on it (SSP), or by its GOSGD peers waiting
for its goodbye; ``abort_after`` then ends the job with one line."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from conftest import launcher, run_mpi

pytestmark = [pytest.mark.mpi]

PATIENCE = ("watchdog.warn_after=2", "watchdog.abort_after=5")


def hung(mpiexec: str, out: Path, *overrides: str) -> tuple[str, float, int]:
    """Digits on 3 ranks with rank 2 hanging at step 15: (stderr, seconds, exit status)."""
    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={out}", "session.epochs=3",
            "inject.rank=2", "inject.step=15", "inject.action=hang", *PATIENCE, *overrides]  # fmt: skip
    start = time.monotonic()
    proc = run_mpi(mpiexec, 3, args, timeout=90)
    return proc.stderr, time.monotonic() - start, proc.returncode


def test_a_hung_worker_is_named_by_its_server_and_by_the_worker_held_for_it(
    mpiexec: str, tmp_path: Path
) -> None:
    stderr, seconds, code = hung(mpiexec, tmp_path, "RULE=SSP", "rule.staleness=2")
    assert code != 0 and seconds < 60, stderr[-3000:]
    assert re.search(r"stall: parameter server rank 0 has waited \d+ s for a push from rank\(s\) 2\b", stderr)
    assert re.search(
        r"stall: worker rank 1 has waited \d+ s for the reply to push \d+ from rank\(s\) 0", stderr
    )
    errors = [line for line in stderr.splitlines() if "error:" in line and "aborting" in line]
    assert len(errors) == 1 and "abort_after = 5 s" in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr


def test_gosgd_peers_name_the_rank_whose_goodbye_never_comes(mpiexec: str, tmp_path: Path) -> None:
    stderr, seconds, code = hung(mpiexec, tmp_path, "RULE=GOSGD", "session.epochs=1")
    assert code != 0 and seconds < 60, stderr[-3000:]
    assert re.search(r"stall: GOSGD rank [01] has waited \d+ s for the goodbye from rank\(s\) 2\b", stderr)
    assert "abort_after = 5 s" in stderr and "Traceback" not in stderr
