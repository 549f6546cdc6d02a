"""The gradient noise scale B_noise (mpicrossbow/training/tuning/noise_scale.py): against the analytic answer
of a linear regression through ``train_step`` under every way the big batch is formed, through a real pool,
and in checkpoints.

Linear regression y = x·w* + ε, x ~ N(0, I_d), ε ~ N(0, σ²), loss ½(x·w − y)², at a fixed w = w* + δ: a
sample's gradient is g = x (x·δ − ε), so G = E[g] = δ and, by Isserlis' theorem,
E[g gᵀ] = |δ|² I + 2 δδᵀ + σ² I, hence tr(Σ) = (d + 1)|δ|² + d σ² and B_noise = tr(Σ)/|G|² exactly.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import OPTIM, only_run, run_mpi
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.report.cli import main as report_main
from mpicrossbow.report.figure import report_figure
from mpicrossbow.report.run_data import load_run
from mpicrossbow.rules import Rule
from mpicrossbow.rules.bsp import BSP
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.reporting.metrics import read_metrics
from mpicrossbow.training.run.step import train_step
from mpicrossbow.training.tuning.noise_scale import NoiseScale, two_batch_estimates

SCRIPTS = Path(__file__).parent / "mpi_scripts"

DIM, BATCH, SIGMA2 = 10, 8, 1.0
#: |δ|² = 1, so B_noise = (d + 1) + d σ².
EXACT = (DIM + 1) + DIM * SIGMA2


class Flat:
    """One learner of :class:`RegressionPool`: flat params, grads and (no) buffers."""

    def __init__(self) -> None:
        self.params = torch.zeros(DIM, dtype=torch.float64)
        self.grads = torch.zeros(DIM, dtype=torch.float64)
        self.buffers = torch.zeros(0, dtype=torch.float64)


class RegressionPool(LearnerPool):
    """m learners that all sit at w = w* + δ and compute their batch-``BATCH`` gradient of the regression;
    ``apply`` leaves w where it is, so every step samples the same gradient distribution."""

    def __init__(self, learners: int, seed: int) -> None:
        self.learners = [Flat() for _ in range(learners)]  # type: ignore[misc]
        self.delta = torch.ones(DIM, dtype=torch.float64) / math.sqrt(DIM)  # |δ|² = 1
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def n_batch_train(self) -> int:
        """Steps per epoch (any)."""
        return 100

    def start_epoch(self, epoch: int) -> None:
        """Nothing to shuffle."""

    def compute(self, count: int) -> None:
        """Each learner's mean gradient over ``BATCH`` fresh samples."""
        for learner in self.learners:
            x = torch.randn(BATCH, DIM, dtype=torch.float64, generator=self.generator)
            noise = torch.randn(BATCH, dtype=torch.float64, generator=self.generator) * math.sqrt(SIGMA2)
            learner.grads.copy_(x.T @ (x @ self.delta - noise) / BATCH)

    def apply(self) -> None:
        """w stays at w* + δ."""

    def set_lr(self, lr: float, epoch: int) -> None:
        """No optimizer."""

    def validate(self, params: torch.Tensor | None = None, data: Any = None) -> tuple[float, float, float]:
        """Not validated."""
        return 0.0, 0.0, 0.0

    def take_stats(self) -> tuple[float, float, float]:
        """No statistics."""
        return 0.0, 0.0, 0.0


class Asynchronous(Rule):
    """A rule whose ranks run at their own pace (no collective between bind and finish)."""

    name = "ASYNC-TEST"

    @property
    def synchronous(self) -> bool:
        """Never synchronous."""
        return False


def measure(
    size: int, learners: int, make_rule: Callable[[], Rule], steps: int, smoothing: float = 0.998
) -> list[float]:
    """Every rank's B_noise after ``steps`` steps of ``train_step`` with the probe on each step."""

    def body(comm: Communicator) -> float:
        pool = RegressionPool(learners, seed=1000 + comm.rank)
        rule = make_rule().bind(comm, pool)
        probe = NoiseScale(every=1, smoothing=smoothing)
        for step in range(steps):
            train_step(pool, rule, step, probe=probe)
        rule.finish()
        assert probe.estimates in (0, steps)  # every step measured, or none where it cannot be
        return probe.value(BATCH)

    return InProcessWorld(size, timeout_s=120).run(body)


@pytest.mark.parametrize(
    ("size", "learners", "make_rule"),
    [
        (1, 4, lambda: BSP(mode="grad", bucket_mb=0)),  # BSP's mean over the rank's 4 learners
        (4, 1, lambda: BSP(mode="grad", bucket_mb=0)),  # BSP's mean over 4 ranks: the pooled sums
        (2, 3, lambda: BSP(mode="avg")),  # a synchronous rule without a mean gradient: each rank's 3
        (1, 4, Asynchronous),  # an asynchronous rank alone
    ],
    ids=["bsp-learners", "bsp-ranks", "sync-per-rank", "async"],
)
def test_the_estimate_is_within_ten_percent_of_the_analytic_noise_scale(
    size: int, learners: int, make_rule: Callable[[], Rule]
) -> None:
    """A user reading B_noise gets tr(Σ)/|G|² within 10 %, whichever way the step forms the big batch."""
    values = measure(size, learners, make_rule, steps=1500)
    for value in values:
        assert value == pytest.approx(EXACT, rel=0.10), (values, EXACT)
    if make_rule is not Asynchronous:
        assert len(set(values)) == 1, values  # a synchronous job's ranks agree


def test_one_learner_on_one_rank_is_not_estimable() -> None:
    """No second batch size: NaN, never a made-up number."""
    (value,) = measure(1, 1, lambda: BSP(mode="grad", bucket_mb=0), steps=5)
    assert math.isnan(value)
    assert all(math.isnan(v) for v in two_batch_estimates(1.0, 1.0, 1))


def test_only_due_steps_are_measured_and_a_checkpoint_continues_the_averages() -> None:
    """``every`` steps apart; the state saved after half the steps, loaded into a fresh probe, ends where
    an uninterrupted probe ends."""

    def run(probe: NoiseScale, pool: RegressionPool, rule: Rule, steps: range) -> None:
        for step in steps:
            train_step(pool, rule, step, probe=probe)

    def body(comm: Communicator) -> tuple[float, float, int]:
        whole, first = NoiseScale(5, 0.9), NoiseScale(5, 0.9)
        pools = [RegressionPool(2, seed=7), RegressionPool(2, seed=7)]
        rules = [Rule().bind(comm, pool) for pool in pools]
        run(whole, pools[0], rules[0], range(100))
        run(first, pools[1], rules[1], range(50))
        resumed = NoiseScale(5, 0.9)
        resumed.load_state_dict(first.state_dict())
        run(resumed, pools[1], rules[1], range(50, 100))
        return whole.value(BATCH), resumed.value(BATCH), whole.estimates

    ((whole, resumed, estimates),) = InProcessWorld(1).run(body)
    assert estimates == 20 and math.isfinite(whole)
    assert resumed == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize(("learners", "make_rule"), [(1, lambda: BSP()), (2, lambda: BSP(mode="avg"))])
def test_a_real_pool_gives_a_finite_positive_noise_scale(
    learners: int, make_rule: Callable[[], Rule]
) -> None:
    """The digits MLP on 2 in-process ranks through ``train_step``: BSP (one allreduce, one learner per
    rank: the pooled mean) and parameter averaging with 2 learners per rank (each rank's own mean).

    The pools (their networks) are built here, one after the other from their seeds, not in the ranks'
    threads: those share torch's global generator, so the threads' interleaving decided the initial weights,
    and with some draws the estimate of |G|² after 30 steps was not positive (the noise scale NaN by
    definition; CI on e9e9262).
    """
    steps = 30
    pools = []
    for rank in range(2):
        torch.manual_seed(rank)
        spec = PoolSpec(rank, 2, 8, OPTIM, torch.device("cpu"), seed=1, learners=learners)
        pools.append(SerialPool(MLP(hidden=16), spec))

    def body(comm: Communicator) -> float:
        pool = pools[comm.rank]
        rule = make_rule().bind(comm, pool)
        probe = NoiseScale(every=2, smoothing=0.9)
        pool.start_epoch(0)
        for step in range(steps):
            train_step(pool, rule, step, probe=probe)
        rule.finish()
        assert probe.estimates == steps // 2
        return probe.value(8)

    values = InProcessWorld(2, timeout_s=60).run(body)
    assert all(math.isfinite(v) and v > 0 for v in values) and values[0] == values[1], values


@pytest.mark.mpi
def test_an_mnist1d_run_records_plots_and_mirrors_its_noise_scale(
    mpiexec: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """launch/mnist1d.cfg on 2 MPI ranks with 2 learners each for 3 epochs: a finite, positive B_noise per
    epoch in metrics.h5 (train/noise_scale), the same in TensorBoard, drawn and named by crossbow-report."""
    args = [sys.executable, str(SCRIPTS / "cfg_runs.py"), str(tmp_path), "mnist1d=launch/mnist1d.cfg", "--"]
    common = ["session.epochs=3", "pool.learners=2", "session.tensorboard=true"]
    proc = run_mpi(mpiexec, 2, [*args, *common], timeout=240)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    folder = only_run(tmp_path / "mnist1d")
    noise = read_metrics(folder / "metrics.h5")["train"]["noise_scale"]
    assert len(noise) == 3 and np.isfinite(noise).all() and (noise > 0).all(), noise
    assert report_main([str(folder)]) == 0
    assert f"B_noise: {noise[-1]:,.0f} samples" in capsys.readouterr().out
    lines = {line.get_gid(): line for ax in report_figure([load_run(folder)]).axes for line in ax.lines}
    np.testing.assert_array_equal(lines["0:noise_scale"].get_xydata()[:, 1], noise)
    assert lines["0:global_batch"].get_ydata()[0] == 2 * 32 * 2  # learners x batch x ranks
    pytest.importorskip("tensorboard", reason="pip install 'mpicrossbow[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tb")).Reload()
    np.testing.assert_allclose([s.value for s in events.Scalars("train/noise_scale")], noise, rtol=1e-6)


def test_a_value_that_cannot_be_estimated_is_said_once_naming_where_it_shows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The line names where the NaN shows: crossbow-launch's metrics.h5, or the embedded API's
    xb.noise_scale() (issue 51: an embedded run said metrics.h5, which it never writes)."""
    probe = NoiseScale(1, 0.9, record="xb.noise_scale() returns NaN")
    with caplog.at_level("INFO", logger="mpicrossbow.training.tuning.noise_scale"):
        probe._update(math.nan, math.nan)
        probe._update(math.nan, math.nan)
    said = [r.getMessage() for r in caplog.records if "not estimable" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("; xb.noise_scale() returns NaN"), said
    assert NoiseScale(1, 0.9).record == "metrics.h5 holds NaN"
