"""Checkpoints of asynchronous rules under real ``mpiexec``: coordinated snapshots, the SIGUSR1 stop and its
resume for every asynchronous rule (one 3-rank launch, tests/mpi_scripts/async_snapshots.py), and as a user
meets them: ``crossbow-launch`` stopped by SIGUSR1 exits 75 and resumes, a SIGKILLed rank's job resumes
from its last complete snapshot."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from conftest import launcher, only_run, run_mpi, verdicts
from mpicrossbow.errors import STOPPED_EXIT_CODE
from mpicrossbow.training.checkpoints.checkpoint_files import complete_checkpoints

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


def job(
    mpiexec: str, out: Path, *overrides: str, rule: tuple[str, ...] = ("RULE=ASGD",), timeout: float = 150
) -> CompletedProcess:
    """An asynchronous rule on 3 ranks (ASGD: a server, two workers), digits for 4 epochs, ``overrides``."""
    args = [*launcher(), "-cfg", "launch/digits.cfg", *rule, f"session.output={out}", "session.epochs=4",
            *overrides]  # fmt: skip
    return run_mpi(mpiexec, 3, args, timeout=timeout)


def test_sigusr1_stops_an_asynchronous_job_with_75_and_it_resumes(mpiexec: str, tmp_path: Path) -> None:
    stopped = job(mpiexec, tmp_path, "inject.rank=2", "inject.step=25", "inject.action=signal")
    assert stopped.returncode == STOPPED_EXIT_CODE, stopped.stderr[-3000:]
    step = int(re.search(r"stopped by a signal after step (\d+)", stopped.stderr)[1])
    assert [p.name for p in complete_checkpoints(only_run(tmp_path) / "checkpoints")] == [f"step-{step:09d}"]
    resumed = job(mpiexec, tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{step:09d} (step {step})" in resumed.stderr
    assert "Traceback" not in stopped.stderr + resumed.stderr


def test_a_killed_gossip_job_resumes_from_its_last_complete_snapshot(mpiexec: str, tmp_path: Path) -> None:
    """GOSGD (no server: every rank a peer) with rank 1 SIGKILLed at step 50: the job fails, and ``--resume``
    finishes from its last complete snapshot. (A server's or centre's job killed the same way:
    test_a_dead_server_ends_the_job_within_30_s_naming_it_and_it_resumes_from_its_snapshot below.)"""
    rule = ("RULE=GOSGD", "rule.p=0.3")
    crashed = job(mpiexec, tmp_path, "checkpoint.every_steps=20", "inject.rank=1", "inject.step=50",
                  "inject.action=kill", rule=rule)  # fmt: skip
    assert crashed.returncode != 0
    saved = complete_checkpoints(only_run(tmp_path) / "checkpoints")
    assert saved, "no snapshot before the kill"
    resumed = job(mpiexec, tmp_path, "checkpoint.every_steps=20", "--resume", rule=rule)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{saved[-1].name} (step " in resumed.stderr


@pytest.mark.parametrize(
    ("rule", "after"),
    [
        (("RULE=ASGD",), 100),  # the server, rank 0: after 100 pushes (two workers, about step 50 each)
        (("RULE=SSP", "rule.placement=colocated"), 50),  # rank 0 trains and serves shard 0: at its step 50
        (("RULE=EASGD", "rule.mode=async", "rule.tau=2"), 50),  # the centre: after 50 requests
    ],
    ids=["parameter-server", "colocated-shard", "elastic-centre"],
)
def test_a_dead_server_ends_the_job_within_30_s_naming_it_and_it_resumes_from_its_snapshot(
    mpiexec: str, tmp_path: Path, rule: tuple[str, ...], after: int
) -> None:
    """The server (or centre, or rank 0's colocated shard) SIGKILLed after two snapshots: the job ends
    within 30 s of the kill with one line naming rank 0; the last snapshot is complete and the resume
    finishes."""
    crashed = job(mpiexec, tmp_path, "checkpoint.every_steps=20", "inject.rank=0", f"inject.step={after}",
                  "inject.action=kill", rule=rule, timeout=120)  # fmt: skip
    ended = time.time()
    output = crashed.stdout + crashed.stderr
    assert crashed.returncode != 0, output[-3000:]
    killed = re.search(r"(\d\d):(\d\d):(\d\d) \[rank 0[^]]*\] WARNING \[inject\] kill", crashed.stderr)
    assert killed is not None, output[-3000:]
    h, m, sec = (int(v) for v in killed.groups())
    clock = time.localtime(ended)
    since = (clock.tm_hour * 3600 + clock.tm_min * 60 + clock.tm_sec - (h * 3600 + m * 60 + sec)) % 86400
    assert since < 30, (since, output[-3000:])
    pids = dict(re.findall(r"(\d+): pid (\d+)", re.search(r"rank processes: (.*)", crashed.stderr)[1]))
    named = re.findall(r"rank 0 on \S+ \(pid \d+\) is gone|PID (\d+) RUNNING AT", output)
    assert named and all(pid in ("", pids["0"]) for pid in named), output[-3000:]
    saved = complete_checkpoints(only_run(tmp_path) / "checkpoints")
    assert len(saved) >= 2, saved  # the kill came after two snapshots
    resumed = job(mpiexec, tmp_path, "checkpoint.every_steps=20", "--resume", rule=rule)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{saved[-1].name} (step " in resumed.stderr
