"""Crossbow's learner auto-tuner: scripted throughput sequences, and the rules following the resize it
drives (the pools' resize itself is the pool contract's, test_pool_contract.py)."""

from __future__ import annotations

import pytest
import torch

from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.comm.inprocess import InProcessWorld
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP, GOSGD, SMA
from mpicrossbow.training.autotune import AutoTuner, StepMeter


def feed(tuner: AutoTuner, throughputs: list[float]) -> list[int]:
    """The learner count the tuner asks for after each measurement."""
    return [tuner.observe(t) for t in throughputs]


def test_grows_while_throughput_rises_then_drops_the_last_and_freezes() -> None:
    tuner = AutoTuner(threshold=0.1, max_learners=16)
    # 1 → 2 (+50%) → 3 (+13%) → 4 (+3%: not enough): back to 3, frozen; later checks change nothing.
    assert feed(tuner, [100, 150, 170, 175, 999]) == [2, 3, 4, 3, 3]
    assert tuner.frozen and tuner.learners == 3
    assert tuner.history == [(1, 100), (2, 150), (3, 170), (4, 175)]


def test_a_drop_at_the_first_step_keeps_one_learner() -> None:
    tuner = AutoTuner(threshold=0.1)
    assert feed(tuner, [100, 90]) == [2, 1]
    assert tuner.frozen and tuner.learners == 1


def test_threshold_is_relative_to_the_last_accepted_count() -> None:
    tuner = AutoTuner(threshold=0.25)
    assert feed(tuner, [100, 124, 500]) == [2, 1, 1]  # +24% < 25%: the second learner is dropped


def test_stops_at_max_learners() -> None:
    tuner = AutoTuner(threshold=0.0, max_learners=3)
    assert feed(tuner, [1, 2, 3, 4]) == [2, 3, 3, 3]
    assert tuner.frozen and tuner.learners == 3
    assert AutoTuner(max_learners=1).frozen


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="threshold"):
        AutoTuner(threshold=-1)
    with pytest.raises(ValueError, match="max_learners"):
        AutoTuner(start=5, max_learners=4)


def make_pool(learners: int) -> SerialPool:
    return SerialPool(
        MLP(hidden=8), PoolSpec(0, 1, 8, OptimSection(lr=0.1), torch.device("cpu"), learners=learners)
    )


def test_rules_follow_a_resize() -> None:
    def body(comm: Communicator) -> None:
        pool = make_pool(1)
        sma = SMA().bind(comm, pool)
        assert sma.alpha == 0.2  # the default: min(0.2, 0.9 × the stability bound)
        pool.learners[0].params.add_(1.0)  # the learner drifted from z
        pool.resize(24)
        sma.on_resize()
        # at k = 24, 0.9 × the bound 2(1+μ)/(k+1+μ) is below 0.2: the default α follows k down
        assert sma.alpha == pytest.approx(0.9 * 3.8 / 25.9) and len(sma.corrections) == 24
        for learner in pool.learners[1:]:  # new learners start from z
            assert torch.equal(learner.params, sma.z)
        BSP().bind(comm, pool).on_resize()
        with pytest.raises(ConfigError, match="GOSGD does not support"):
            GOSGD().bind(comm, pool).on_resize()

    InProcessWorld(1).run(body)


def test_the_step_meter_counts_steady_steps_only_and_starts_anew() -> None:
    """The tuner's measurement: the mean of the steady steps' times (a form trial's steps left out)."""
    meter = StepMeter()
    assert meter.take() is None  # no step yet: the loop falls back to the whole epoch's time
    for seconds, steady in [(5.0, False), (5.0, False), (1.0, True), (3.0, True)]:
        meter.add(seconds, steady)
    assert meter.take() == pytest.approx(2.0)
    assert meter.take() is None
    meter.add(4.0, False)
    assert meter.take() is None
