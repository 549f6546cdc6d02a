"""Theano-MPI's example cfgs, its facade and Theano-form models under real ``mpiexec`` (and a plain process
whose ``rule.init`` starts the job): every runnable example cfg trains, BSP, EASGD with a server, GOSGD and
SMA bring a Theano-form model to its target at 2 and 4 ranks, and nothing unreported is logged as a value."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

from conftest import launcher, only_run, run_local, run_mpi
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.mpi]
SCRIPTS = Path(__file__).parent / "mpi_scripts"
GOLDEN = "tests/data/theano_mpi"
#: Final validation accuracy every Theano-form run reaches on the digits in 10 epochs (measured 0.96-0.98).
TARGET = 0.93


def ran(stdout: str) -> dict[str, float]:
    """``{label: accuracy}`` from the scripts' ``RAN <label> <accuracy>`` lines."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^RAN (\S+) (\S+)$", stdout, re.M)}


def test_theano_mpis_example_cfgs_train_under_mpiexec(mpiexec: str, tmp_path: Path) -> None:
    """Every runnable example cfg (only model and devices rewritten), the Theano-form CIFAR-10 port's cfg in
    the dialect, and a model that reports only its training cost, in one 2-rank job."""
    runs = [
        f"single={GOLDEN}/session_single_node.cfg",
        f"multi={GOLDEN}/session_multi_node.cfg",
        f"lstm={GOLDEN}/session_lstm_2gpu.cfg",
        f"size={GOLDEN}/session_size.cfg",
        f"gap={GOLDEN}/session_gap.cfg",
        "cifar=launch/theano_cifar10.cfg,session.epochs=2",
        f"silent={GOLDEN}/session_single_node.cfg,MODELFILE=tests.data.theano_models,MODELCLASS=ReturnsCost,session.progress=log",
    ]
    proc = run_mpi(
        mpiexec, 2, [sys.executable, str(SCRIPTS / "cfg_runs.py"), str(tmp_path), *runs], timeout=240
    )
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    accuracy = ran(proc.stdout)
    assert all(accuracy[label] >= TARGET for label in ("single", "multi", "lstm", "size", "gap", "cifar")), (
        accuracy
    )
    metrics = read_metrics(only_run(tmp_path / "silent") / "metrics.h5")
    assert all(math.isfinite(v) for v in metrics["train"]["loss"])
    assert all(math.isnan(v) for v in metrics["train"]["accuracy"]) and math.isnan(accuracy["silent"])
    assert all(math.isnan(v) for column in ("loss", "accuracy") for v in metrics["val"][column])
    silent = [line for line in proc.stderr.splitlines() if "acc n/a" in line or "accuracy n/a" in line]
    assert any("train loss 0." in line and "acc n/a | val loss n/a acc n/a" in line for line in silent), (
        silent
    )


@pytest.mark.parametrize("n", [2, 4])
def test_a_theano_form_model_reaches_its_target_under_each_theano_mpi_rule(
    mpiexec: str, tmp_path: Path, n: int
) -> None:
    """BSP, EASGD with a server (rank 0), GOSGD and SMA, each through ``rule.init(...)``/``wait()`` inside
    the MPI job."""
    proc = run_mpi(
        mpiexec, n, [sys.executable, str(SCRIPTS / "theano_facade.py"), str(tmp_path)], timeout=240
    )
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    accuracy = ran(proc.stdout)
    assert sorted(accuracy) == ["BSP", "EASGD", "GOSGD", "SMA"] and min(accuracy.values()) >= TARGET, accuracy


def test_rule_init_starts_the_job_from_a_plain_process(tmp_path: Path) -> None:
    proc = run_local([sys.executable, str(SCRIPTS / "theano_facade.py"), str(tmp_path)], timeout=300)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    accuracy = ran(proc.stdout)
    assert sorted(accuracy) == ["BSP", "EASGD", "GOSGD", "SMA"] and min(accuracy.values()) >= TARGET, accuracy


def test_a_size_the_job_does_not_have_is_one_line(mpiexec: str) -> None:
    args = [*launcher(), "-cfg", f"{GOLDEN}/session_size.cfg", "DEVICES=cpu"]
    proc = run_mpi(mpiexec, 4, args, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("crossbow-launch: error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines == ["crossbow-launch: error: SIZE=2 but the job has 4 rank(s); start it with -n 2"], lines


def test_every_rule_that_exchanges_weights_runs_a_theano_form_model(mpiexec: str, tmp_path: Path) -> None:
    """The parameter-server rules (rank 0 serves), LOCALSGD and DILOCO on 3 ranks, each to the target."""
    rules = ("ASGD", "SSP", "PSGD", "WEEDOUT", "LOCALSGD", "DILOCO")
    runs = [f"{rule}={GOLDEN}/session_single_node.cfg,RULE={rule}" for rule in rules]
    args = [sys.executable, str(SCRIPTS / "cfg_runs.py"), str(tmp_path), *runs, "--", "DEVICES=cpu"]
    proc = run_mpi(mpiexec, 3, args, timeout=240)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    accuracy = ran(proc.stdout)
    assert sorted(accuracy) == sorted(rules) and min(accuracy.values()) >= TARGET, accuracy
