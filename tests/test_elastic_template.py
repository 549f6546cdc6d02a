"""launch/slurm/elastic.sbatch's own logic around Open MPI's mpiexec, run by bash with the variables Slurm
sets and stand-ins for mpiexec and scontrol: what the job's status and last lines are when Open MPI's runtime
misbehaves after training has finished (each seen with Open MPI 5.0.11 after a replacement was spawned across
nodes), that a crash of mpiexec before the finish requeues the job (or, when it cannot, fails it with one line
saying why), and that a kill before the finish keeps its status. No Slurm needed: sbatch only runs the script;
the templates under a real Slurm are tests/test_slurm.py's and tests/test_slurm_netns.py's.
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
    # dies of SIGABRT before any rank finished, once the run saved step 44 (and began step 66's save)
    "aborts before the finish": (
        'saved="$RUNS/7/the-run/checkpoints"\n'
        'mkdir -p "$saved/step-000000044" "$saved/step-000000066.partial"\n'
        'touch "$saved/step-000000044/meta.pt"\n'
        'sleep 0.1; touch "$saved/step-000000066.partial/meta.pt"\nkill -ABRT $$\n'
    ),
    # loses node2's daemon once the run saved step 44: Open MPI's runtime ends every rank, mpiexec exits 0
    "loses a node before the finish": (
        'mkdir -p "$RUNS/7/the-run/checkpoints/step-000000044"\n'
        'touch "$RUNS/7/the-run/checkpoints/step-000000044/meta.pt"\n'
        "printf '%s\\n' 'PRTE has lost communication with a remote daemon.' '' "
        "'  Remote daemon: [prterun-node1-180@0,1] on node node2' '' >&2\nexit 0\n"
    ),
    # dies of SIGABRT before the first checkpoint
    "aborts before a checkpoint": "kill -ABRT $$\n",
    # killed (SIGKILL: the machine's out-of-memory killer, a user) before the finish: not a crash of its own
    "is killed before the finish": "kill -KILL $$\n",
}
#: A stand-in for Slurm's scontrol: says whether job 7 is requeueable (REQUEUE, 1 or 0) and logs requests.
SCONTROL = """#!/bin/bash
echo "$*" >> "${0%/*}/scontrol.log"
if [[ "$1 $2 $3" == "-o show job" ]]; then echo "JobId=$4 JobName=xbow Requeue=$REQUEUE Restarts=0"; fi
"""


def run_template(
    tmp_path: Path, mpiexec: str, requeueable: bool = True, **variables: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run elastic.sbatch as sbatch would, one node and one task, ``mpiexec`` standing in for Open MPI's and
    ``scontrol`` for Slurm's (its requests in ``tmp_path/bin/scontrol.log``)."""
    fake = tmp_path / "mpiexec"
    fake.write_text(VERSION + mpiexec)
    fake.chmod(0o755)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text(SCONTROL)
    (bin_ / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "REQUEUE": "1" if requeueable else "0",
        **variables,
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


#: What the template says Open MPI's runtime did, by stand-in.
ENDED = {
    "aborts before the finish": "Open MPI's mpiexec crashed (signal 6) before training had finished, no rank "
    "at fault",
    "loses a node before the finish": "Open MPI lost its daemon on node node2 and ended every rank (Open MPI "
    "5.0 survives lost ranks, not a lost node)",
}


@pytest.mark.parametrize("case", list(ENDED))
def test_a_runtime_that_ends_the_run_before_the_finish_requeues_the_job_from_its_newest_checkpoint(
    tmp_path: Path, case: str
) -> None:
    """Open MPI's runtime ending every rank before rank 0's report, no rank at fault — its mpiexec dying of
    SIGABRT (seen with Open MPI 5.0.11 as the survivors spawned a replacement across nodes), or a lost node's
    daemon (Open MPI 5.0 survives lost ranks, not a lost node; mpiexec exits 0): the job is requeued, as
    after a preemption, with one warning naming the run folder whose checkpoints it resumes from (that of
    the newest complete checkpoint; which one the resume takes, its own line says), and exits with the
    stopped status 75."""
    proc, _ = run_template(tmp_path, MPIEXECS[case])
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-3000:])
    (warned,) = warnings_of(proc.stderr)
    assert warned == (
        f"crossbow-launch: warning: {ENDED[case]}: requeueing Slurm job 7; it resumes from the checkpoints "
        f"saved in {tmp_path / 'runs'}/7/the-run"
    ), warned
    assert (tmp_path / "bin" / "scontrol.log").read_text().splitlines() == ["-o show job 7", "requeue 7"]
    assert sorted(p.name for p in (tmp_path / "runs" / "7").glob(".*")) == []  # nothing left behind


@pytest.mark.parametrize("case", ["not requeueable", "restarted twice", "requeue = false", "no checkpoint"])
def test_a_crash_that_cannot_requeue_fails_the_job_with_one_line_saying_why_and_how_to_resume(
    tmp_path: Path, case: str
) -> None:
    """The requeue after mpiexec's crash needs a requeueable job (``sbatch --requeue``), fewer restarts than
    CRASH_REQUEUES (2: a runtime that crashes every time does not requeue forever) and ``[checkpoint]
    requeue`` not false; otherwise the job fails (status 1) with one error line saying why and what to
    resume."""
    crash = "aborts before a checkpoint" if case == "no checkpoint" else "aborts before the finish"
    mpiexec = MPIEXECS[crash]
    variables = {"SLURM_RESTART_COUNT": "2"} if case == "restarted twice" else {}
    if case == "requeue = false":
        cfg = tmp_path / "no-requeue.cfg"
        cfg.write_text((REPO / "launch" / "digits.cfg").read_text() + "\n[checkpoint]\nrequeue = false\n")
        variables["CFG"] = str(cfg)
    requeueable = case not in ("not requeueable", "no checkpoint")
    proc, _ = run_template(tmp_path, mpiexec, requeueable=requeueable, **variables)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert not warnings_of(proc.stderr), proc.stderr[-3000:]
    why = {
        "not requeueable": "Slurm job 7 is not requeueable (sbatch --requeue)",
        "restarted twice": "job 7 has been restarted 2 time(s) (CRASH_REQUEUES=2)",
        "requeue = false": "[checkpoint] requeue = false",
        "no checkpoint": "Slurm job 7 is not requeueable (sbatch --requeue)",
    }[case]
    then = (
        "no checkpoint saved yet"
        if case == "no checkpoint"
        else f"resume with checkpoint.resume={tmp_path / 'runs'}/7/the-run"
    )
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "crossbow-launch: error: Open MPI's mpiexec crashed (signal 6) before training had finished, no rank "
        f"at fault; not requeued ({why}): {then}"
    ), proc.stderr[-3000:]
    asked = tmp_path / "bin" / "scontrol.log"
    assert "requeue 7" not in (asked.read_text() if asked.exists() else ""), proc.stderr[-3000:]


def test_a_runtime_killed_before_the_finish_keeps_its_status(tmp_path: Path) -> None:
    """An mpiexec ended by SIGKILL (the out-of-memory killer, a user) did not crash: no requeue, no line of
    the template's, its status (128 + 9) is the job's."""
    proc, _ = run_template(tmp_path, MPIEXECS["is killed before the finish"])
    assert proc.returncode == 128 + 9, (proc.returncode, proc.stderr[-3000:])
    assert "crossbow-launch:" not in proc.stderr, proc.stderr[-3000:]


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
