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

from benchmarks.tta_grid import DDP, XB, Run, Setup, alpha_value, load_grid, summarise, winners

GRID = Path(__file__).parents[1] / "benchmarks" / "tta.cfg"


def test_the_grid_file_gives_both_sides_one_schedule_and_every_configuration() -> None:
    grid = load_grid(GRID, {"tasks": "mnist1d,digits"})  # the file's default: mnist1d alone
    assert set(grid.tasks) == {"mnist1d", "digits"} and grid.tasks["mnist1d"].target == 0.94
    assert set(load_grid(GRID).tasks) == {"mnist1d"}
    mnist1d = grid.tasks["mnist1d"]
    assert (mnist1d.max_epochs, mnist1d.warmup_epochs, mnist1d.milestones) == (60, 2, (36, 51))
    assert grid.tasks["digits"].target == 0.97 and grid.seeds == (0, 1, 2) and grid.validate_every == 0.25
    setups = grid.setups(grid.tasks["mnist1d"])
    ddp = [s for s in setups if s.side == DDP]
    xb = [s for s in setups if s.side == XB]
    assert sorted({s.global_batch for s in ddp}) == [32, 64, 128, 256, 512] and len(ddp) == 15
    assert {s.rule for s in xb} == {"BSP", "SMA", "EASGD", "LOCALSGD", "POSTLOCALSGD"}
    assert {s.engine for s in xb} == {"fused"} and len(setups) == len(set(setups))
    bsp = [s for s in xb if s.rule == "BSP"]
    assert {s.learners for s in bsp} == {1, 2, 4, 8, 16} and len(bsp) == 15
    sma = [s for s in xb if s.rule == "SMA" and not s.tune]
    assert {s.alpha for s in sma} == {"0.1", "1/k", "2/k"} and {s.learners for s in sma} == {2, 4, 8}
    assert {s.scaling for s in sma} == {"none", "sqrt", "linear"} and len(sma) == 27
    assert sorted(s.tune for s in xb if s.tune) == ["goodput", "throughput"]
    assert grid.rule_settings["POSTLOCALSGD"] == {"then": "SMA", "switch": "epoch", "switch_epoch": "5"}


def test_learning_rates_follow_each_sides_rule_from_the_task() -> None:
    narrow = {"rules": "BSP,SMA", "learners": "4", "global_batches": "128", "alphas": "0.1"}
    grid = load_grid(GRID, narrow)
    task = grid.tasks["mnist1d"]  # base_lr 0.1 at a global batch of 64; η0 = 0.025, capped at 0.2
    setups = grid.setups(task)
    assert sorted(s.lr for s in setups if s.side == DDP) == pytest.approx([0.05, 0.1, 0.2])
    # BSP averages 2 ranks x 4 learners x 16 = 128 samples a step: the linear-scaling centre 0.2
    assert sorted(s.lr for s in setups if s.rule == "BSP") == pytest.approx([0.05, 0.1, 0.2])
    # SMA's k = 8 learners step on 16 each: η0 x {1, √8, 8 (capped)}
    sma = {s.scaling: s.lr for s in setups if s.rule == "SMA" and not s.tune}
    assert sma == pytest.approx({"none": 0.025, "sqrt": 0.025 * math.sqrt(8), "linear": 0.2})
    assert sorted(s.lr for s in setups if s.tune) == [0.025, 0.025]  # each tuner scales by its own k


def test_alpha_forms_resolve_for_k_and_stay_inside_smas_bound_on_the_grid() -> None:
    from mpicrossbow.rules.sma_stability import alpha_bound

    assert alpha_value("0.1", 8) == 0.1 and alpha_value("1/k", 8) == 0.125 and alpha_value("2/k", 16) == 0.125
    grid = load_grid(GRID)
    for s in grid.setups(grid.tasks["mnist1d"]):
        if s.alpha:
            k = grid.ranks * s.learners
            assert alpha_value(s.alpha, k) < alpha_bound(k, grid.tasks["mnist1d"].momentum), s.label


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
    tuned = run(Setup(XB, 0.025, rule="SMA", engine="fused", batch=16, tune="goodput"), 0, 1.0)
    assert Run.from_dict(json.loads(json.dumps(tuned.as_dict()))) == tuned


@pytest.mark.mpi
@pytest.mark.slow
def test_a_narrowed_grid_trains_both_sides_to_the_digits_target(tmp_path: Path) -> None:
    """DDP at one global batch and SMA at 2 learners per rank, each at three learning rates, and SMA's goodput
    tuner, one seed: every run is recorded, the centre rate of each side and the tuner reach 97 %, and
    validations fall about a quarter epoch apart."""
    out = tmp_path / "runs.json"
    args = [
        sys.executable, "-m", "benchmarks.tta", "--tasks", "digits", "--seeds", "0", "--global-batches",
        "32", "--rules", "SMA", "--learners", "2", "--lr-scalings", "none,sqrt,linear", "--alphas", "0.1",
        "--tuners", "goodput", "--runs", str(out), "--no-write",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=GRID.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["digits"]
    assert len(runs) == 7 and {r["setup"]["side"] for r in runs} == {DDP, XB}
    tuned = [r for r in runs if r["setup"]["tune"]]
    assert len(tuned) == 1 and tuned[0]["final_accuracy"] >= 0.97 and tuned[0]["seconds"] > 0, tuned

    def centre_lr(r: dict) -> float:
        return 0.05 if r["setup"]["side"] == DDP else 0.025

    centre = [r for r in runs if not r["setup"]["tune"] and math.isclose(r["setup"]["lr"], centre_lr(r))]
    # (DDP: the linear-scaling centre 0.05 x 32 / 32; SMA: η0 = 0.025, lr_scaling none)
    assert len(centre) == 2 and all(r["final_accuracy"] >= 0.97 and r["seconds"] > 0 for r in centre), centre
    for r in centre:
        epochs = [p[1] for p in r["curve"]]
        assert all(0.15 <= b - a <= 0.35 for a, b in itertools.pairwise(epochs)), epochs
    assert "best mpicrossbow ÷ best DDP time to target" in proc.stdout
