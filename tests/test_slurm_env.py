"""What a job reads from Slurm and asks of it (launch/slurm.py), and the requeue decisions built on that
(training/health/preemption.py), against a stand-in ``scontrol`` on PATH that records its calls."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from conftest import REPO
from mpicrossbow.config import load_config
from mpicrossbow.errors import STOPPED_EXIT_CODE
from mpicrossbow.launch.slurm import SlurmJob, in_slurm_allocation, srun_tasks_without_pmi
from mpicrossbow.launch.spawn import default_ranks
from mpicrossbow.launch.world import World
from mpicrossbow.training.health.preemption import after_signal_stop, automatic_resume, requeue, written_by

JOB_ENV = {
    "SLURM_JOB_ID": "4711",
    "SLURM_ARRAY_JOB_ID": "4700",
    "SLURM_ARRAY_TASK_ID": "3",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_RESTART_COUNT": "2",
}


def fake_scontrol(folder: Path, requeue_flag: int, fails: bool = False) -> Path:
    """An ``scontrol`` that answers ``show job`` with ``Requeue=<flag>`` and logs every call."""
    log = folder / "calls"
    script = folder / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        f'if [ "$1" = "-o" ]; then echo "JobId=$4 JobName=x Requeue={requeue_flag} Restarts=0"; fi\n'
        + ('if [ "$1" = requeue ]; then echo "Requested operation is presently disabled" >&2; exit 1; fi\n'
           if fails else "")
    )  # fmt: skip
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return log


@pytest.fixture
def scontrol_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    return tmp_path


def test_slurm_allocation_sets_the_launcher_and_rank_count() -> None:
    assert in_slurm_allocation({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "6"})
    assert not in_slurm_allocation({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})  # inside srun already
    assert not in_slurm_allocation({})
    assert default_ranks({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "6"}) == 6


def test_an_srun_step_without_pmi_is_recognised() -> None:
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}
    assert srun_tasks_without_pmi(step) == 2
    assert srun_tasks_without_pmi({**step, "PMI_RANK": "1", "PMI_SIZE": "2"}) == 0  # --mpi=pmi2
    assert srun_tasks_without_pmi({**step, "PMIX_RANK": "1"}) == 0  # --mpi=pmix
    assert srun_tasks_without_pmi({**step, "SLURM_STEP_NUM_TASKS": "1"}) == 0  # one task runs alone, fine
    assert srun_tasks_without_pmi({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}) == 0  # the batch shell


def test_the_job_record_names_job_array_nodes_and_restarts() -> None:
    job = SlurmJob.from_env(JOB_ENV)
    assert job is not None and job.restart_count == 2
    assert job.record() == {
        "slurm_job_id": "4711",
        "slurm_array_job_id": "4700",
        "slurm_array_task_id": "3",
        "slurm_nodelist": "n[1-2]",
        "slurm_restart_count": 2,
    }
    assert SlurmJob.from_env({"SLURM_JOB_ID": "9"}).record() == {
        "slurm_job_id": "9",
        "slurm_restart_count": 0,
    }
    assert SlurmJob.from_env({}) is None


@pytest.mark.parametrize(
    ("setting", "flag", "fails", "requeued", "calls"),
    [
        ("auto", 1, False, True, ["-o show job 4711", "requeue 4711"]),
        ("auto", 0, False, False, ["-o show job 4711"]),  # not requeueable: only asked
        ("true", 0, True, False, ["requeue 4711"]),  # asked for, refused: logged, still exit 75
        ("false", 1, False, False, []),
    ],
)
def test_a_signal_stop_requeues_only_when_the_setting_and_the_job_allow_it(
    scontrol_dir: Path,
    setting: str,
    flag: int,
    fails: bool,
    requeued: bool,
    calls: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The line saying the job requeues comes before the request (Slurm ends the run as it takes it), and
    an error line follows a refused one."""
    log = fake_scontrol(scontrol_dir, flag, fails)
    config = load_config(REPO / "launch" / "digits.cfg", [f"checkpoint.requeue={setting}"])
    with caplog.at_level(logging.WARNING):
        assert requeue(config, SlurmJob.from_env(JOB_ENV), scontrol_dir) is requeued
    assert (log.read_text().splitlines() if log.exists() else []) == calls
    said = [r.getMessage().split(":")[0] for r in caplog.records]
    asked = "requeue 4711" in calls
    assert said.count("requeueing Slurm job 4711") == int(asked)
    assert any(line.startswith("could not requeue Slurm job 4711") for line in said) == (asked and fails)


def test_every_rank_exits_75_after_a_signal_stop_outside_slurm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    world = World(0, 1, 0, 1, 0, 1, "h", None)
    config = load_config(REPO / "launch" / "digits.cfg")
    assert after_signal_stop(world, config, tmp_path) == STOPPED_EXIT_CODE == 75


def test_a_requeued_job_resumes_by_itself_from_the_run_folder_it_wrote(tmp_path: Path) -> None:
    config = load_config(REPO / "launch" / "digits.cfg")
    job = SlurmJob.from_env(JOB_ENV)
    assert automatic_resume(config, job)
    assert not automatic_resume(config, SlurmJob.from_env({**JOB_ENV, "SLURM_RESTART_COUNT": "0"}))
    assert not automatic_resume(
        load_config(REPO / "launch" / "digits.cfg", ["checkpoint.requeue=false"]), job
    )
    # before [checkpoint] resume, which names where the job's first run started (test_reliability_mpi.py)
    assert automatic_resume(load_config(REPO / "launch" / "digits.cfg", ["checkpoint.resume=x"]), job)
    assert job is not None
    mine, other = tmp_path / "mine", tmp_path / "other"
    for folder, header in ((mine, job.record()), (other, {"slurm_job_id": "12"})):
        folder.mkdir()
        lines = [f"{k} = {v}" for k, v in header.items()]
        (folder / "session.cfg").write_text(config.to_ini(header=lines))
    assert written_by(mine, job) and not written_by(other, job) and not written_by(tmp_path, job)
    assert load_config(mine / "session.cfg").rule == config.rule  # the header keeps the cfg loadable
