"""The fused engine's one chooser (mpicrossbow.pool.fused.chooser): each path chosen and each pinned, the
step-form trial's schedule and decision, and the record the run keeps of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fused import plain, pools, train_alongside
from test_replicated import CumulativeNet, DerivedWeightNet, ValueBranchNet
from torch import nn

from conftest import launcher, only_run, run_mpi
from models.lenet import LeNet
from models.mlp import MLP
from mpicrossbow.errors import ContractError
from mpicrossbow.pool.fused.chooser import FUSED, UNFUSED, Chooser
from mpicrossbow.pool.fused.fused_network import FusedNetwork
from mpicrossbow.pool.fused.replicated_network import ReplicatedNetwork
from mpicrossbow.pool.fused.vmapped import VmappedNetwork
from mpicrossbow.report.run_data import load_run
from mpicrossbow.report.summary import fused_line, summary
from mpicrossbow.training.reporting.metrics import read_metrics

#: Each network and the path ``fuse = auto`` settles on for it.
CHOSEN = {
    "layers": (lambda: MLP(hidden=8), FusedNetwork),
    "replicated": (lambda: plain(CumulativeNet, (1, 8, 8), 10), ReplicatedNetwork),
    "vmapped": (lambda: plain(DerivedWeightNet, (1, 8, 8), 10), VmappedNetwork),
    "unfused": (lambda: plain(ValueBranchNet, (1, 8, 8), 10), None),
}


def trial(setting: str = "auto", rounds: int = 4) -> Chooser:
    """A chooser whose paths build nothing (the trial's bookkeeping alone)."""
    return Chooser(setting, {}, rounds=rounds)


def run_trial(choice: Chooser, seconds: dict[str, list[float]]) -> list[str]:
    """Drive ``choice`` with scripted step times per form; the forms it asked for, in order."""
    asked, left = [], {form: list(times) for form, times in seconds.items()}
    while choice.chosen is None:
        form = choice.form()
        asked.append(form)
        choice.record_step(left[form].pop(0) if choice.timing else None)
    return asked


@pytest.mark.parametrize("path", list(CHOSEN))
def test_auto_chooses_the_first_path_that_runs_and_records_it(path: str) -> None:
    make, network = CHOSEN[path]
    serial, fused = pools(make(), 3, fuse="auto")
    train_alongside(serial, fused, 3)  # the path settles on the first step (the trial's fused warm-up)
    if network is not None:
        assert isinstance(fused.fused, network) and fused.choice.path == path
    record = fused.run_record()
    assert record["fused_path"] == path and (fused.choice.chosen is None) == (path != UNFUSED)
    choice = json.loads(record["fused_choice"])
    assert choice["setting"] == "auto" and list(choice["refused"]) == list(fused.choice.refused)
    assert len(choice["refused"]) == list(CHOSEN).index(path)


@pytest.mark.parametrize(
    ("setting", "network"),
    [
        ("layers", FusedNetwork),
        *[(p, n) for p, n in (("replicated", ReplicatedNetwork), ("vmapped", VmappedNetwork))],
    ],
)
def test_each_fused_path_pinned_runs_and_equals_serial(setting: str, network: type[nn.Module]) -> None:
    serial, fused = pools(MLP(hidden=8), 3, fuse=setting)
    train_alongside(serial, fused)
    assert isinstance(fused.fused, network) and fused.choice.chosen == FUSED and not fused.choice.refused
    assert fused.run_record()["fused_path"] == setting


def test_never_pins_the_replicas_one_after_another() -> None:
    serial, fused = pools(MLP(hidden=8), 3, fuse="never")
    train_alongside(serial, fused)
    assert fused.choice.chosen == UNFUSED and fused.run_record()["fused_path"] == UNFUSED


@pytest.mark.parametrize(
    ("setting", "make", "why"),
    [
        ("layers", lambda: plain(CumulativeNet, (1, 8, 8), 10), "cannot fuse layer type CumulativeNet"),
        ("replicated", lambda: plain(DerivedWeightNet, (1, 8, 8), 10), "computed from a parameter"),
        ("vmapped", lambda: plain(ValueBranchNet, (1, 8, 8), 10), "vmap: "),
    ],
)
def test_a_pinned_path_that_cannot_run_the_network_is_an_error_naming_it(
    setting: str, make: Any, why: str
) -> None:
    with pytest.raises(
        ContractError, match=rf"\[pool\] fuse = {setting}: the {setting} path cannot run .*{why}"
    ):
        _, fused = pools(make(), 2, fuse=setting)
        fused.start_epoch(0)
        fused.compute(0)


class Failing(nn.Module):
    """A forward that fails for a reason of its own, not a path's refusal."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the model's own bug")


def test_an_error_that_is_no_refusal_is_raised_not_taken_for_one() -> None:
    _, fused = pools(plain(Failing, (1, 8, 8), 10), 2, fuse="auto")
    fused.start_epoch(0)
    with pytest.raises(ValueError, match="the model's own bug"):
        fused.compute(0)
    assert fused.choice.path == "replicated" and list(fused.choice.refused) == ["layers"]


def test_the_convolutions_forms_are_recorded() -> None:
    _, fused = pools(LeNet(), 2)
    fused.start_epoch(0)
    fused.compute(0)
    convs = json.loads(fused.run_record()["fused_choice"])["conv_forms"]
    assert [c["form"] for c in convs.values()] == ["channels_last", "channels_last"]


def test_the_report_summary_says_the_path_what_was_refused_and_why() -> None:
    """crossbow-report's line for a network only vmap fuses: its path, both paths refused with their
    reasons, and the step form with the fastest step of each."""
    make, _ = CHOSEN["vmapped"]
    serial, fused = pools(make(), 3, fuse="auto")
    train_alongside(serial, fused, 3)
    choice = json.loads(fused.run_record()["fused_choice"])
    line = fused_line(choice)
    assert line.startswith("  fused engine ([pool] fuse = auto): vmapped path; refused: layers (")
    assert f"replicated ({choice['refused']['replicated']})" in line
    timed = trial(rounds=2)
    run_trial(timed, {FUSED: [0.1, 0.3], UNFUSED: [0.2, 0.2]})
    line = fused_line(json.loads(timed.record()["fused_choice"]))
    assert line.endswith("; step form fused (fastest step: fused 100.000 ms, unfused 200.000 ms)"), line


def test_an_unknown_setting_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="choose one of auto, always, never, layers, replicated, vmapped"):
        trial("sometimes")


def test_always_and_never_choose_without_a_trial() -> None:
    assert trial("always").chosen == FUSED and trial("always").steps_to_decide == 0
    assert trial("never").form() == UNFUSED and trial("layers").form() == FUSED


def test_the_trial_warms_up_then_alternates_and_keeps_the_faster_form() -> None:
    choice = trial(rounds=3)
    assert choice.steps_to_decide == 8
    # Fused's best step (0.1) beats unfused's (0.2); one step slowed by other load does not count.
    asked = run_trial(choice, {FUSED: [0.1, 0.1, 0.9], UNFUSED: [0.2, 0.2, 0.2]})
    assert asked == [FUSED, UNFUSED, FUSED, UNFUSED, UNFUSED, FUSED, FUSED, UNFUSED]
    assert choice.chosen == FUSED and choice.form() == FUSED and not choice.timing
    assert choice.times == {FUSED: [0.1, 0.1, 0.9], UNFUSED: [0.2, 0.2, 0.2]}
    assert json.loads(choice.record()["fused_choice"])["form_ms"] == pytest.approx({FUSED: 100, UNFUSED: 200})


def test_the_unfused_form_wins_when_fusing_does_not_pay() -> None:
    choice = trial(rounds=2)
    run_trial(choice, {FUSED: [0.5, 0.4], UNFUSED: [0.3, 0.35]})
    assert choice.chosen == UNFUSED


def test_a_resumed_trial_continues_where_it_stood() -> None:
    first = trial()
    for _ in range(3):
        first.record_step(0.1 if first.timing else None)
    second = trial()
    second.load_state_dict(first.state_dict())
    assert second.form() == first.form() and second.steps_to_decide == first.steps_to_decide == 7
    fixed = trial("never")
    fixed.load_state_dict(first.state_dict())
    assert fixed.chosen == UNFUSED


@pytest.mark.mpi
def test_a_job_logs_its_path_and_records_it_in_metrics(mpiexec: str, tmp_path: Path) -> None:
    """crossbow-launch on 2 ranks, the path pinned: the log says it, metrics.h5 keeps rank 0's choice."""
    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={tmp_path}", "session.epochs=1"]
    args += ["pool.engine=fused", "pool.learners=2", "pool.fuse=replicated"]
    proc = run_mpi(mpiexec, 2, args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0/2] INFO fused engine: runs the replicated path" in proc.stderr, proc.stderr[-3000:]
    attrs = read_metrics(only_run(tmp_path) / "metrics.h5")["attrs"]
    assert attrs["fused_path"] == "replicated"
    choice = json.loads(attrs["fused_choice"])
    assert choice["setting"] == "replicated" and choice["form"] == FUSED and choice["refused"] == {}
    said = summary(load_run(only_run(tmp_path)))  # crossbow-report's text
    assert "\n  fused engine ([pool] fuse = replicated): replicated path\n" in said + "\n", said
