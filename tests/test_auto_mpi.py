"""RULE=AUTO through ``crossbow-launch``'s real path: the decision in one line and in metrics.h5, and a run
killed after the switch, resumed from a checkpoint on either side of the decision, ends bitwise equal to an
uninterrupted run.

The digits job on 2 ranks for 2 epochs of 44 steps, measuring windows of 27 steps. With every candidate AUTO
measures under LOCALSGD, whose window ends on its first average from step 26 on (after step 31, so the
decision is at step 32), and the choice depends on this machine's timings, so the first test checks only that
the line and the attributes agree and hold every candidate. With ``candidates = SMA`` the choice is forced:
BSP for 27 measured steps, SMA from step 27; checkpoints every 20 steps, rank 1 fails at step 70. Resumed from
step 20 the run measures and decides again; resumed from step 60 it restores SMA's phase and state.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_postlocalsgd_mpi import assert_same, final_state

from conftest import REPO, launcher, only_run, run_mpi
from mpicrossbow.report.summary import auto_line
from mpicrossbow.rules.rule_choice import MARGIN, offered
from mpicrossbow.training.checkpoints.checkpoint_files import complete_checkpoints
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.mpi]

DECISION = 27
#: The first decision under LOCALSGD: after the first of its averages (every 8th step) from step 26 on.
UNDER_LOCALSGD = 32


def job(mpiexec: str, out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """The digits job under AUTO on 2 ranks (2 epochs, checkpoints every 20 steps), with ``overrides``.
    One decision: ``recheck`` is off (a CI run's load once moved the steps past 2x the prediction, AUTO
    decided again and metrics.h5 held that later decision; a link that slows is test_auto.py's)."""
    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={out}", "session.epochs=2",
            "checkpoint.every_steps=20", "RULE=AUTO", f"rule.measure_steps={DECISION}",
            "rule.recheck=false", *overrides]  # fmt: skip
    return run_mpi(mpiexec, 2, args, timeout=90)


def test_the_decision_is_one_line_and_the_same_in_metrics(mpiexec: str, tmp_path: Path) -> None:
    # lr_scaling tells AUTO which epochs table to read; capped at the cfg's own lr, it changes no rate here
    done = job(mpiexec, tmp_path, "optim.lr_scaling=linear", "optim.lr_cap=0.05")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if f"AUTO at step {UNDER_LOCALSGD}: chose " in line]
    assert len(lines) == 1, done.stderr[-3000:]
    assert ", lr_scaling linear, " in lines[0], lines[0]
    # a candidate kept out only by the margin runs one window on trial, then the measured steps decide
    trial = re.search(r"chose (.+?) for one window on trial \(predicted ", lines[0])
    if trial is not None:
        ended = (
            f"AUTO at step {UNDER_LOCALSGD + DECISION} (again: {trial[1]}'s window on trial ended): chose "
        )
        lines = [line for line in done.stderr.splitlines() if ended in line]
        assert len(lines) == 1, done.stderr[-3000:]
    # the running rule kept (a move needs MARGIN x its time) adds "(kept: ...)" after the choice
    chosen = re.search(r"chose (.+?)(?: \(kept: .+?, a move needs \S+ or less\))?; time to target ", lines[0])
    assert chosen is not None
    for label in ("BSP 1.00 (", "SMA ", "LOCALSGD (period 8) "):
        assert label in lines[0], lines[0]
    attrs = read_metrics(only_run(tmp_path) / "metrics.h5")["attrs"]
    assert attrs["rule_auto_choice"] == chosen[1] and attrs["rule_auto_line"] in lines[0]
    assert attrs["rule_auto_candidates"].split("; ")[0] == chosen[1]
    assert sorted(attrs["rule_auto_candidates"].split("; ")) == sorted(offered("linear"))
    predicted = attrs["rule_auto_predicted"]
    soonest = min(row[2] for row in predicted)
    kept = "(kept: " in lines[0]  # the running rule stays unless another needs MARGIN x its time or less
    assert len(predicted) == len(offered("linear")) and (
        soonest > MARGIN * predicted[0][2] if kept else predicted[0][2] == soonest
    )
    state = final_state(tmp_path, 0)["rule"]  # the choice runs from its move on (LOCALSGD: from 0)
    assert state["decided"] == chosen[1] and state["lr_scaling"] == "linear"
    moves = {(None, "LOCALSGD (period 8)"): 0, ("BSP", "LOCALSGD (period 8)"): UNDER_LOCALSGD + DECISION}
    assert state["switched_at"] == moves.get((trial and trial[1], chosen[1]), UNDER_LOCALSGD)
    last = UNDER_LOCALSGD + (DECISION if trial else 0)  # crossbow-report's summary line: every decision
    assert auto_line(attrs).startswith("  rule = AUTO: ") and auto_line(attrs).endswith(
        f"{chosen[1]} from step {last}; last decision: {attrs['rule_auto_line']}"
    )
    assert attrs["val_accuracy"] >= 0.7  # it trains on (BSP, SMA and LOCALSGD read 0.80-0.86 after 2 epochs)


def test_a_run_killed_after_the_switch_resumes_bitwise_equal_from_either_side(
    mpiexec: str, tmp_path: Path
) -> None:
    forced = ("rule.candidates=SMA",)
    whole, before, after = tmp_path / "whole", tmp_path / "before", tmp_path / "after"
    done = job(mpiexec, whole, *forced)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"AUTO at step {DECISION}: chose SMA; time to target relative to BSP: SMA " in done.stderr
    crashed = job(mpiexec, before, *forced, "inject.rank=1", "inject.step=70")
    assert crashed.returncode != 0 and "rank 1 of 2" in crashed.stderr
    shutil.copytree(before, after)
    checkpoints = only_run(before) / "checkpoints"
    assert [p.name for p in complete_checkpoints(checkpoints)] == [f"step-{s:09d}" for s in (20, 40, 60)]
    crossing = job(mpiexec, before, *forced, f"checkpoint.resume={checkpoints / 'step-000000020'}")
    assert crossing.returncode == 0, crossing.stderr[-3000:]
    assert f"AUTO at step {DECISION}: chose SMA" in crossing.stderr
    restored = job(mpiexec, after, *forced, "--resume")
    assert restored.returncode == 0, restored.stderr[-3000:]
    assert "step-000000060 (step 60)" in restored.stderr and "AUTO at step" not in restored.stderr
    for rank in (0, 1):
        reference = final_state(whole, rank)
        assert reference["rule"]["switched_at"] == DECISION and reference["rule"]["decided"] == "SMA"
        assert "z" in reference["rule"]["then"]
        for resumed in (before, after):
            state = final_state(resumed, rank)
            assert_same(reference["pool"], state["pool"], f"{resumed.name} rank {rank} pool")
            # timings, not state: each decision's predicted seconds and how many windows in a row drifted
            timed = [row[:2] for row in state["rule"].pop("decisions")]
            state["rule"].pop("drifted")
            assert timed == [row[:2] for row in reference["rule"]["decisions"]] == [[DECISION, "SMA"]]
            expected = {k: v for k, v in reference["rule"].items() if k not in ("decisions", "drifted")}
            assert_same(expected, state["rule"], f"{resumed.name} rank {rank} rule")


def test_print_config_under_mpiexec_shows_what_auto_would_choose_here_and_runs_nothing(
    mpiexec: str, tmp_path: Path
) -> None:
    """``mpiexec -n 2 crossbow-launch ... RULE=AUTO --print-config``: the resolved cfg once, then rank 0's
    decision line as a comment, from a measuring window taken on these ranks; no run folder. Started alone
    it says how to see the choice."""
    args = [
        *launcher(),
        "-cfg",
        "launch/digits.cfg",
        f"session.output={tmp_path}",
        "RULE=AUTO",
        "--print-config",
    ]
    shown = run_mpi(mpiexec, 2, args, timeout=90)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert shown.stdout.count("[rule]\n") == 1 and "measure_steps = 10\n" in shown.stdout
    last = shown.stdout.splitlines()[-1]
    assert last.startswith("# RULE = AUTO here: chose ") and "over 2 rank(s)" in last, shown.stdout[-2000:]
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []
    alone = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert alone.returncode == 0 and alone.stdout.splitlines()[-1].startswith(
        "# RULE = AUTO chooses from the job's own step time and link: start --print-config under mpiexec"
    )
