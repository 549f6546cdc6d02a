"""The showdown's grid and arithmetic (benchmarks/tta_grid.py): the cfg anyone reruns, the learning-rate
rule, medians over seeds with a missed target ranked last, each side's winner; and (slow, under mpiexec) a
narrowed grid trained end to end by ``python -m benchmarks.tta`` on digits."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.tta_grid import DDP, XB, Run, Setup, load_grid, summarise, winners

GRID = Path(__file__).parents[1] / "benchmarks" / "tta.cfg"


def test_the_grid_file_names_both_tasks_and_every_configuration() -> None:
    grid = load_grid(GRID)
    assert set(grid.tasks) == {"mnist1d", "digits"} and grid.tasks["mnist1d"].target == 0.94
    assert grid.tasks["digits"].target == 0.97 and grid.seeds == (0, 1, 2) and grid.validate_every == 0.25
    setups = grid.setups(grid.tasks["mnist1d"])
    ddp = [s for s in setups if s.side == DDP]
    xb = [s for s in setups if s.side == XB]
    assert sorted({s.global_batch for s in ddp}) == [32, 64, 128, 256, 512] and len(ddp) == 15
    assert {s.rule for s in xb} == {"BSP", "SMA", "EASGD", "LOCALSGD"} and len(xb) == 4 * 5 * 2 * 3
    assert {s.learners for s in xb} == {1, 2, 4, 8, 16} and {s.engine for s in xb} == {"serial", "fused"}


def test_learning_rates_follow_linear_scaling_from_the_task_base() -> None:
    grid = load_grid(GRID, {"rules": "BSP,SMA", "learners": "4", "engines": "fused", "global_batches": "128"})
    task = grid.tasks["mnist1d"]  # base_lr 0.1 at a global batch of 64
    setups = grid.setups(task)
    assert sorted(s.lr for s in setups if s.side == DDP) == pytest.approx([0.05, 0.1, 0.2])
    # BSP averages 2 ranks x 4 learners x 16 = 128 samples a step; SMA's learners step on 16 each
    assert sorted(s.lr for s in setups if s.rule == "BSP") == pytest.approx([0.05, 0.1, 0.2])
    assert sorted(s.lr for s in setups if s.rule == "SMA") == pytest.approx([0.00625, 0.0125, 0.025])


def run(setup: Setup, seed: int, seconds: float, accuracy: float = 0.95) -> Run:
    return Run(setup, seed, seconds, seconds / 10, 1000.0, accuracy, [(seconds, seconds / 10, accuracy)])


def test_medians_rank_a_missed_target_last_and_pick_each_sides_winner() -> None:
    nan = math.nan
    ddp = Setup(DDP, 0.1, global_batch=64)
    fast_xb = Setup(XB, 0.05, rule="SMA", learners=4, engine="fused", batch=16)
    flaky_xb = Setup(XB, 0.2, rule="BSP", learners=16, engine="fused", batch=16)
    runs = [run(ddp, s, t) for s, t in enumerate((4.0, 5.0, 6.0))]
    runs += [run(fast_xb, 0, 3.0), run(fast_xb, 1, nan), run(fast_xb, 2, 2.0)]  # median: 3.0
    runs += [run(flaky_xb, 0, 1.0), run(flaky_xb, 1, nan), run(flaky_xb, 2, nan)]  # most missed
    rows = summarise(runs)
    assert [r.setup for r in rows] == [fast_xb, ddp, flaky_xb]
    assert rows[0].seconds == 3.0 and rows[0].reached == 2 and rows[1].seconds == 5.0
    assert math.isnan(rows[2].seconds) and rows[2].reached == 1
    best = winners(rows)
    assert best[XB] is rows[0] and best[DDP] is rows[1]
    assert rows[0].median_run.seconds == 3.0  # the curve drawn is the median seed's
    two = summarise([run(ddp, 0, 2.0), run(ddp, 1, 4.0)])
    assert two[0].seconds == 3.0


def test_runs_survive_the_json() -> None:
    setup = Setup(XB, 0.05, rule="SMA", learners=4, engine="fused", batch=16)
    original = run(setup, 1, 2.5)
    again = Run.from_dict(json.loads(json.dumps(original.as_dict())))
    assert again == original


@pytest.mark.mpi
@pytest.mark.slow
def test_a_narrowed_grid_trains_both_sides_to_the_digits_target(tmp_path: Path) -> None:
    """One DDP and one mpicrossbow setup at three learning rates each, one seed: every run is recorded, the
    default learning rate of each reaches 97 %, and validations fall about a quarter epoch apart."""
    out = tmp_path / "runs.json"
    args = [
        sys.executable, "-m", "benchmarks.tta", "--tasks", "digits", "--seeds", "0", "--global-batches",
        "32", "--rules", "SMA", "--learners", "2", "--engines", "fused", "--runs", str(out), "--no-write",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=GRID.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["digits"]
    assert len(runs) == 6 and {r["setup"]["side"] for r in runs} == {DDP, XB}
    centre = [r for r in runs if math.isclose(r["setup"]["lr"], 0.05 if r["setup"]["side"] == DDP else 0.025)]
    # (the grid's factor 1: DDP 0.05 x 32 / 32, SMA 0.05 x 16 / 32)
    assert len(centre) == 2 and all(r["final_accuracy"] >= 0.97 and r["seconds"] > 0 for r in centre), centre
    for r in centre:
        epochs = [p[1] for p in r["curve"]]
        assert all(0.15 <= b - a <= 0.35 for a, b in itertools.pairwise(epochs)), epochs
    assert "best mpicrossbow ÷ best DDP time to target" in proc.stdout
