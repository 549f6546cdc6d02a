"""Coordinated snapshots in elastic asynchronous runs (issue 40, training/elastic/elastic_pause.py), in real
Open MPI jobs under ``mpiexec --with-ft ulfm`` (:mod:`openmpi_env`; the tests skip, saying why, without it): a
lost worker is survived with snapshots on, a lost parameter server or EASGD centre ends the job in one line
with the last complete snapshot intact, and ``--resume`` finishes from it."""

from __future__ import annotations

import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from conftest import only_run, run_local
from mpicrossbow.launch.failure import ERROR_PREFIX
from mpicrossbow.training.checkpoints.checkpoint_files import complete_checkpoints
from openmpi_env import OpenMPIEnv

pytestmark = [pytest.mark.mpi]

#: Every job: digits for 4 epochs on 4 ranks (rank 0 serves or holds the centre; GOSGD: all four gossip),
#: elastic, a snapshot every 10 of a training rank's steps, the signal stop on (the default).
SNAPSHOTS = ("session.epochs=4", "elastic.enabled=true", "checkpoint.every_steps=10")


def job(openmpi: OpenMPIEnv, out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """The elastic digits job with snapshots and ``overrides``, under ``--with-ft ulfm``."""
    args = ["-cfg", "launch/digits.cfg", f"session.output={out}", *SNAPSHOTS, *overrides]
    return run_local(openmpi.ft_command(4, openmpi.launch, *args), timeout=180)


def error_lines(stderr: str) -> list[str]:
    """The failure lines of a job (what a user reads)."""
    lines = (line.replace("\0", "").lstrip() for line in stderr.splitlines())
    return [line for line in lines if line.startswith(ERROR_PREFIX)]


def killed_at(stderr: str, run: Path) -> float:
    """When the injected fault fired, as a POSIX time: its log line's wall-clock time (to the second), or,
    for ``kill_in_save`` (which logs nothing), when the killed rank last wrote into the cut-short save."""
    clocks = re.findall(r"^(\d\d:\d\d:\d\d) .*\[inject\] kill at step", stderr, re.M)
    if clocks:
        today = datetime.now().strftime("%Y-%m-%d")
        return datetime.strptime(f"{today} {clocks[0]}", "%Y-%m-%d %H:%M:%S").timestamp()
    return max(p.stat().st_mtime for p in (run / "checkpoints").glob("step-*.partial/*"))


def meta_of(snapshot: Path) -> dict:
    """A snapshot's ``meta.pt``."""
    return torch.load(snapshot / "meta.pt", weights_only=True)


def whole(snapshot: Path) -> bool:
    """Whether ``snapshot`` holds every one of the 4 ranks' files and names no lost rank."""
    meta = meta_of(snapshot)
    files = sorted(p.name for p in snapshot.glob("rank-*.pt"))
    return "lost" not in meta and files == [f"rank-0000{r}.pt" for r in range(4)]


@pytest.mark.parametrize(
    ("rule", "fault", "said"),
    [
        # a serving rank takes no steps: its inject.step counts the requests it answered
        (("RULE=ASGD",), ("inject.step=100", "inject.action=kill"), "a parameter server was lost"),
        (
            ("RULE=ASGD",),
            ("inject.step=20", "inject.action=kill_in_save"),
            "was lost at the snapshot meeting",
        ),
        (
            ("RULE=EASGD", "rule.mode=async"),
            ("inject.step=30", "inject.action=kill"),
            "the EASGD centre (rank 0) was lost",
        ),
    ],
    ids=["ASGD-between-snapshots", "ASGD-in-a-save", "EASGD-async-centre"],
)
def test_a_lost_server_or_centre_ends_in_one_line_and_the_run_resumes(
    openmpi: OpenMPIEnv, tmp_path: Path, rule: tuple[str, ...], fault: tuple[str, ...], said: str
) -> None:
    """Rank 0 (ASGD's server, async EASGD's centre) SIGKILLed between snapshots or while writing one: the
    job ends with status non-zero and one line saying what was lost, within 30 s of the kill; the last
    complete snapshot holds all four ranks' files (a save cut short is a ``.partial`` folder, never
    loaded); ``--resume`` of the run, elastic as before, finishes with status 0 from that snapshot."""
    proc = job(openmpi, tmp_path, *rule, "inject.rank=0", *fault)
    ended = time.time()
    assert proc.returncode not in (0, 75), proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and said in lines[0], proc.stderr[-3000:]
    assert "elastic training survives lost workers only" in lines[0]
    run = only_run(tmp_path)
    assert ended - killed_at(proc.stderr, run) < 30, "one line within 30 s of the kill"
    snapshots = complete_checkpoints(run / "checkpoints")
    assert snapshots and whole(snapshots[-1]), snapshots
    resumed = job(openmpi, tmp_path, *rule, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {snapshots[-1]}" in resumed.stderr
    done = re.search(r"done: .* val accuracy ([0-9.]+)", resumed.stderr)
    # The served model of an asynchronous run moves with the ranks' timing: ASGD resumed here read 0.84-0.92
    # in 6 runs and 0.77 in one CI run (its epoch 3 at 0.89); chance is 0.10.
    assert done and float(done[1]) > 0.7, resumed.stderr[-2000:]


@pytest.mark.parametrize(
    ("rule", "fault"),
    [
        (("RULE=ASGD",), "inject.action=kill"),
        (("RULE=ASGD",), "inject.action=kill_in_save"),
        (("RULE=GOSGD", "rule.p=0.1"), "inject.action=kill"),
        # One server, the three workers one group: the group's pause agreement is a committed group step.
        (("RULE=GSP",), "inject.action=kill"),
    ],
    ids=["ASGD", "ASGD-in-a-save", "GOSGD", "GSP"],
)
def test_a_lost_worker_is_survived_and_the_later_snapshots_hold_the_survivors(
    openmpi: OpenMPIEnv, tmp_path: Path, rule: tuple[str, ...], fault: str
) -> None:
    """Worker rank 2 SIGKILLed at its step 20 (at the step's start, or while writing snapshot 20): the
    snapshot meeting goes on over ranks 0, 1 and 3 (one line), the job finishes with status 0, the snapshots
    before the loss hold four files, the last one the survivors' — named by their start ranks — with the lost
    rank in ``meta.pt``; pruning keeps the newest snapshot with all four, and ``--resume`` of the run
    finishes from it with status 0, one line naming the later snapshots it skipped (``--resume`` of a
    survivors' snapshot itself is refused in one line, exit status 2)."""
    proc = job(openmpi, tmp_path, *rule, "inject.rank=2", "inject.step=20", fault)
    assert proc.returncode == 0, proc.stderr[-3000:]
    met = [line for line in proc.stderr.splitlines() if "at the snapshot meeting" in line]
    assert len(met) == 1 and "lost rank(s) 2 (start numbering)" in met[0], proc.stderr[-3000:]
    assert "start ranks [0, 1, 3]" in met[0]
    run = only_run(tmp_path)
    last = complete_checkpoints(run / "checkpoints")[-1]
    assert sorted(p.name for p in last.glob("rank-*.pt")) == [
        "rank-00000.pt",
        "rank-00001.pt",
        "rank-00003.pt",
    ]
    assert meta_of(last)["lost"] == [2]
    whole_ones = [p for p in complete_checkpoints(run / "checkpoints") if "lost" not in meta_of(p)]
    assert whole_ones and whole(whole_ones[-1]), "pruning keeps the newest snapshot with every rank's files"
    if fault == "inject.action=kill" and rule == ("RULE=ASGD",):
        refused = job(openmpi, tmp_path, *rule, "--resume", str(last))
        assert refused.returncode == 2, refused.stderr[-3000:]
        lines = error_lines(refused.stderr)
        assert len(lines) == 1 and "taken after elastic training lost rank(s) 2" in lines[0], lines
    resumed = job(openmpi, tmp_path, *rule, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {whole_ones[-1]}" in resumed.stderr
    skipped = [line for line in resumed.stderr.splitlines() if "the steps since are trained again" in line]
    assert len(skipped) == 1 and f"the newest {last.name}" in skipped[0], resumed.stderr[-3000:]


@pytest.mark.parametrize(
    "fault",
    [("inject.step=100", "inject.action=kill"), ("inject.step=20", "inject.action=kill_in_save")],
    ids=["between-snapshots", "in-a-save"],
)
def test_a_lost_server_with_a_backup_is_survived_and_the_snapshots_go_on(
    openmpi: OpenMPIEnv, tmp_path: Path, fault: tuple[str, ...]
) -> None:
    """ASGD with ``[elastic] server_backups = 1`` (rank 3 mirrors server rank 0) and a snapshot every 10
    steps: rank 0 SIGKILLed after answering 100 pushes, or while writing snapshot 20. The backup takes over,
    the snapshots go on over ranks 1-3 (the lost server's file missing, rank 0 in ``meta.pt``), the job
    finishes with status 0, every push counted once, and the accuracy of an elastic ASGD run (the rate
    decayed for the last epoch)."""
    backed = ("RULE=ASGD", "elastic.server_backups=1", "optim.milestones=3", "inject.rank=0")
    proc = job(openmpi, tmp_path, *backed, *fault)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert any("backup rank 3: parameter server rank 0 was lost" in line for line in lines), proc.stderr[
        -3000:
    ]
    last = [line for line in lines if "backup rank 3, serving since parameter server rank 0 was lost" in line]
    assert len(last) == 1 and "every push of the 2 finishing worker(s) counted once" in last[0], last
    newest = complete_checkpoints(only_run(tmp_path) / "checkpoints")[-1]
    assert sorted(p.name for p in newest.glob("rank-*.pt")) == [f"rank-0000{r}.pt" for r in (1, 2, 3)]
    assert meta_of(newest)["lost"] == [0]
    assert float(re.findall(r"done: .* val accuracy ([0-9.]+)", proc.stderr)[0]) > 0.85
