"""Checkpoints of asynchronous rules under real ``mpiexec``: coordinated snapshots, the SIGUSR1 stop and its
resume for every asynchronous rule (one 3-rank launch, tests/mpi_scripts/async_snapshots.py), and as a user
meets them: ``crossbow-launch`` stopped by SIGUSR1 exits 75 and resumes, a SIGKILLed rank's job resumes
from its last complete snapshot."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from conftest import launcher, only_run, run_mpi, verdicts
from mpicrossbow.errors import STOPPED_EXIT_CODE
from mpicrossbow.training.checkpoint_files import complete_checkpoints

pytestmark = [pytest.mark.mpi]

SCRIPTS = Path(__file__).parent / "mpi_scripts"

#: Every asynchronous rule, as the script takes them (3 ranks: a server or centre and two workers).
RULES = ("ASGD", "SSP", "PSGD", "WEEDOUT", "GSP", "EASGD:rule.mode=async", "GOSGD:rule.p=0.3",
         "SSP-colocated:rule.placement=colocated")  # fmt: skip


@pytest.fixture(scope="module")
def snapshot_checks(mpiexec: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], str]:
    """The one launch of every rule's checks: (verdicts, stderr tail)."""
    out = tmp_path_factory.mktemp("snapshots")
    args = [sys.executable, str(SCRIPTS / "async_snapshots.py"), str(out), *RULES]
    proc = run_mpi(mpiexec, 3, args, timeout=420)
    assert "DONE" in proc.stdout, proc.stderr[-4000:]
    return verdicts(proc.stdout), proc.stderr[-4000:]


@pytest.mark.parametrize("rule", [r.split(":")[0].lower() for r in RULES])
@pytest.mark.parametrize("check", ["periodic", "signal", "resume"])
def test_every_asynchronous_rule_snapshots_stops_and_resumes(
    snapshot_checks: tuple[dict[str, str], str], rule: str, check: str
) -> None:
    found, tail = snapshot_checks
    assert found.get(f"snapshots.{rule}.{check}") == "OK", (found.get(f"snapshots.{rule}.{check}"), tail)


def job(mpiexec: str, out: Path, *overrides: str, rule: tuple[str, ...] = ("RULE=ASGD",)) -> CompletedProcess:
    """An asynchronous rule on 3 ranks (ASGD: a server, two workers), digits for 4 epochs, ``overrides``."""
    args = [*launcher(), "-cfg", "launch/digits.cfg", *rule, f"session.output={out}", "session.epochs=4",
            *overrides]  # fmt: skip
    return run_mpi(mpiexec, 3, args, timeout=150)


def test_sigusr1_stops_an_asynchronous_job_with_75_and_it_resumes(mpiexec: str, tmp_path: Path) -> None:
    stopped = job(mpiexec, tmp_path, "fault.rank=2", "fault.step=25", "fault.action=signal")
    assert stopped.returncode == STOPPED_EXIT_CODE, stopped.stderr[-3000:]
    step = int(re.search(r"stopped by a signal after step (\d+)", stopped.stderr)[1])
    assert [p.name for p in complete_checkpoints(only_run(tmp_path) / "checkpoints")] == [f"step-{step:09d}"]
    resumed = job(mpiexec, tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{step:09d} (step {step})" in resumed.stderr
    assert "Traceback" not in stopped.stderr + resumed.stderr


@pytest.mark.parametrize(
    "rule",
    [("RULE=ASGD",), ("RULE=GOSGD", "rule.p=0.3"), ("RULE=EASGD", "rule.mode=async")],
    ids=["parameter-server", "gossip", "elastic-centre"],
)
def test_a_killed_asynchronous_job_resumes_from_its_last_complete_snapshot(
    mpiexec: str, tmp_path: Path, rule: tuple[str, ...]
) -> None:
    crashed = job(mpiexec, tmp_path, "checkpoint.every_steps=20", "fault.rank=1", "fault.step=50",
                  "fault.action=kill", rule=rule)  # fmt: skip
    assert crashed.returncode != 0
    saved = complete_checkpoints(only_run(tmp_path) / "checkpoints")
    assert saved, "no snapshot before the kill"
    resumed = job(mpiexec, tmp_path, "checkpoint.every_steps=20", "--resume", rule=rule)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{saved[-1].name} (step " in resumed.stderr
