"""launch/slurm/elastic.sbatch's own logic around Open MPI's mpiexec, run by bash with the variables Slurm
sets and a stand-in mpiexec: what the job's status and last lines are when Open MPI's runtime misbehaves after
training has finished (each seen with Open MPI 5.0.11 after a replacement was spawned across nodes), and
that a failure before the finish still fails the job. No Slurm needed: sbatch only runs the script; the
templates under a real Slurm are tests/test_slurm.py's and tests/test_slurm_netns.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import wait_for

from conftest import REPO

TEMPLATE = REPO / "launch" / "slurm" / "elastic.sbatch"
VENV = Path(sys.executable).parent.parent

#: The start of every stand-in: it says it is Open MPI 5's (the template checks).
VERSION = """#!/bin/bash
if [[ "$1" == --version ]]; then echo "mpiexec (Open MPI) 5.0.11"; exit 0; fi
"""
#: Stand-ins for Open MPI's mpiexec: rank 0's "finished" report (the run folder, as crossbow-launch writes it
#: once the results are saved), then what the runtime did.
MPIEXECS = {
    # stays up, every rank gone: the template ends it LINGER_S seconds after the report
    "lingers": 'echo "$RUNS/the-run" > "$CROSSBOW_FINISHED_FILE"\nexec sleep 600\n',
    # dies of SIGABRT in its teardown ("free(): invalid pointer")
    "aborts after the finish": 'echo "$RUNS/the-run" > "$CROSSBOW_FINISHED_FILE"\nkill -ABRT $$\n',
    # dies of SIGABRT before any rank finished: the job must fail
    "aborts before the finish": "kill -ABRT $$\n",
}


def run_template(tmp_path: Path, mpiexec: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run elastic.sbatch as sbatch would, one node and one task, ``mpiexec`` standing in for Open MPI's."""
    fake = tmp_path / "mpiexec"
    fake.write_text(VERSION + mpiexec)
    fake.chmod(0o755)
    env = {
        **os.environ,
        "VENV": str(VENV),
        "MPIEXEC": str(fake),
        "LINGER_S": "2",
        "RUNS": str(tmp_path / "runs"),
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "1",
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    proc = subprocess.run(
        ["bash", str(TEMPLATE)], env=env, capture_output=True, text=True, timeout=60, start_new_session=True
    )
    return proc, fake


def warnings_of(err: str) -> list[str]:
    """The template's own warning lines."""
    return [line for line in err.splitlines() if line.startswith("crossbow-launch: warning:")]


@pytest.mark.parametrize("case", ["lingers", "aborts after the finish"])
def test_a_runtime_that_misbehaves_after_the_finish_completes_the_job_with_one_warning(
    tmp_path: Path, case: str
) -> None:
    """After rank 0 reported the run finished: an mpiexec still up LINGER_S seconds later is ended, and one
    that dies of a signal in its teardown is forgiven; either way status 0 and one warning naming where the
    complete results are, instead of a failed job (or one holding its allocation to the time limit)."""
    started = time.monotonic()
    proc, fake = run_template(tmp_path, MPIEXECS[case])
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    (warned,) = warnings_of(proc.stderr)
    what = "was still running 2 s after training had finished" if case == "lingers" else "died of signal 6"
    assert what in warned, warned
    assert warned.endswith(f"the results are complete in {tmp_path / 'runs'}/the-run"), warned
    assert time.monotonic() - started < 30
    assert not list((tmp_path / "runs" / "7").glob(".finished-*"))  # the template's own files removed
    wait_for(lambda: not any(str(fake) in cmd for cmd in commands()), 10, "the stand-in mpiexec gone")


def test_a_runtime_that_dies_before_the_finish_fails_the_job(tmp_path: Path) -> None:
    """The forgiveness needs rank 0's report: an mpiexec that dies of SIGABRT before it keeps its status
    (128 + 6, what Slurm records as a failed job), with no warning."""
    proc, _ = run_template(tmp_path, MPIEXECS["aborts before the finish"])
    assert proc.returncode == 128 + 6, (proc.returncode, proc.stderr[-3000:])
    assert not warnings_of(proc.stderr), proc.stderr[-3000:]


def commands() -> list[str]:
    """Every live process's command line."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return found
