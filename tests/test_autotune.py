"""Crossbow's learner auto-tuner: scripted throughput and noise-scale sequences for both rules, the tuner's
checkpointed state, and the rules following the resize it drives (the pools' resize itself is the pool
contract's, test_pool_contract.py)."""

from __future__ import annotations

import math

import pytest
import torch

from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP, GOSGD, SMA
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.run.learner_tuning import StepMeter
from mpicrossbow.training.tuning.autotune import AutoTuner, efficiency, start_count

NAN = math.nan


def feed(tuner: AutoTuner, throughputs: list[float], noise: list[float] | None = None) -> list[int]:
    """The learner count the tuner asks for after each measurement (B_noise ``noise``, else unknown)."""
    noise = noise or [NAN] * len(throughputs)
    return [tuner.observe(t, b) for t, b in zip(throughputs, noise, strict=True)]


def throughput_tuner(**kwargs: float) -> AutoTuner:
    """Crossbow's rule: samples/s alone."""
    return AutoTuner(tune="throughput", **kwargs)  # type: ignore[arg-type]


def test_grows_while_throughput_rises_then_drops_the_last_and_freezes() -> None:
    tuner = throughput_tuner(threshold=0.1, max_learners=16)
    # 1 → 2 (+50%) → 3 (+13%) → 4 (+3%: not enough): back to 3, frozen; later checks change nothing.
    assert feed(tuner, [100, 150, 170, 175, 999]) == [2, 3, 4, 3, 3]
    assert tuner.frozen and tuner.learners == 3
    assert [row[:2] for row in tuner.history] == [(1, 100), (2, 150), (3, 170), (4, 175)]
    assert all(row[3] == 1.0 and row[4] == row[1] for row in tuner.history)  # efficiency 1: goodput = rate


def test_a_drop_at_the_first_step_keeps_one_learner() -> None:
    tuner = throughput_tuner(threshold=0.1)
    assert feed(tuner, [100, 90]) == [2, 1]
    assert tuner.frozen and tuner.learners == 1


def test_threshold_is_relative_to_the_last_accepted_count() -> None:
    tuner = throughput_tuner(threshold=0.25)
    assert feed(tuner, [100, 124, 500]) == [2, 1, 1]  # +24% < 25%: the second learner is dropped


def test_stops_at_max_learners() -> None:
    tuner = throughput_tuner(threshold=0.0, max_learners=3)
    assert feed(tuner, [1, 2, 3, 4]) == [2, 3, 3, 3]
    assert tuner.frozen and tuner.learners == 3
    assert AutoTuner(max_learners=1).frozen


def test_the_throughput_rule_ignores_the_noise_scale() -> None:
    tuner = throughput_tuner(threshold=0.1, unit_batch=64)
    assert feed(tuner, [100, 150, 200, 201], [1.0, 1.0, 1.0, 1.0]) == [2, 3, 4, 3]


def test_efficiency_is_pollux_s() -> None:
    assert efficiency(NAN, 256, 64) == 1.0  # unknown: the throughput rule
    assert efficiency(64.0, 64, 64) == 1.0  # the base batch keeps everything
    assert efficiency(64.0, 192, 64) == pytest.approx(128 / 256)
    assert efficiency(1e9, 4096, 64) == pytest.approx(1.0, abs=1e-5)  # huge B_noise: batch is free


def test_goodput_stops_growing_when_efficiency_falls_faster_than_throughput_rises() -> None:
    # B_noise = 128 samples, 64 samples per learner: E(1) = 1, E(2) = 192/256 = 0.75, E(3) = 0.6.
    tuner = AutoTuner(threshold=0.1, unit_batch=64)
    # Throughput +50% then +33%: the throughput rule would take 3 and try 4.
    assert feed(tuner, [100, 150, 200], [128, 128, 128]) == [2, 3, 2]
    # goodput 100 → 112.5 (+12.5%: kept) → 120 (+6.7%: not enough) → back to 2, frozen
    assert tuner.frozen and tuner.learners == 2
    assert [round(row[4], 1) for row in tuner.history] == [100.0, 112.5, 120.0]
    assert throughput_tuner(threshold=0.1).observe(100) == 2
    assert feed(throughput_tuner(threshold=0.1), [100, 150, 200]) == [2, 3, 4]


def test_goodput_grows_when_the_noise_scale_is_large() -> None:
    tuner = AutoTuner(threshold=0.1, max_learners=8, unit_batch=64)
    big = [1e6] * 5
    assert feed(tuner, [100, 150, 200, 250, 255], big) == [2, 3, 4, 5, 4]  # as the throughput rule


def test_goodput_shrinks_after_a_bad_step() -> None:
    tuner = AutoTuner(threshold=0.1, unit_batch=64)
    assert feed(tuner, [100, 80], [1e6, 1e6]) == [2, 1]
    assert tuner.frozen and tuner.learners == 1 and tuner.best == 1


def test_an_unknown_noise_scale_decides_as_throughput_then_rescores_the_counts_tried() -> None:
    """One learner on one rank: no B_noise until the second learner; the first one measured re-scores m = 1
    too, so the comparison is at one B_noise."""
    tuner = AutoTuner(threshold=0.1, unit_batch=32)
    assert tuner.observe(100, NAN) == 2  # unknown: efficiency 1
    assert tuner.history[0][2:] == (pytest.approx(NAN, nan_ok=True), 1.0, 100.0)
    # m = 2 at 160 samples/s (+60%), B_noise = 32 now known: E(2) = 64/96, goodput 107 < 110% of m = 1's 100
    assert tuner.observe(160, 32.0) == 1
    assert tuner.frozen


def test_settled_goodput_follows_a_growing_noise_scale_among_measured_counts() -> None:
    tuner = AutoTuner(threshold=0.1, unit_batch=64)
    assert feed(tuner, [100, 180, 200], [64, 64, 64]) == [2, 3, 2]  # settled at 2 (3: +2.9%)
    # B_noise grows tenfold: the measured 3's goodput 200 × 704/832 = 169 beats 2's 180 × 704/768 = 165 by
    # less than 10%: stays; at B_noise 1e5 the throughputs decide (200 vs 180: +11%): grows to 3.
    assert feed(tuner, [999, 999], [640, 1e5]) == [2, 3]
    assert tuner.learners == 3 and tuner.best == 3
    # B_noise falls back: shrinks to 2 again (never probes a count it has not measured: 4)
    assert feed(tuner, [999], [64]) == [2]
    assert set(tuner.rates) == {1, 2, 3}


def test_the_tuner_state_round_trips() -> None:
    tuner = AutoTuner(threshold=0.1, unit_batch=64)
    feed(tuner, [100, 180, 200], [64, 64, 64])
    again = AutoTuner(threshold=0.1, unit_batch=64)
    again.load_state_dict(tuner.state_dict())
    assert (again.learners, again.frozen, again.best, again.rates) == (2, True, 2, tuner.rates)
    assert again.history == tuner.history
    assert feed(again, [999, 999], [640, 1e5]) == feed(tuner, [999, 999], [640, 1e5])
    with pytest.raises(ValueError, match="tune = goodput"):
        throughput_tuner().load_state_dict(tuner.state_dict())
    fresh = AutoTuner()
    fresh.load_state_dict({})
    assert fresh.learners == 1 and not fresh.history


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="threshold"):
        AutoTuner(threshold=-1)
    with pytest.raises(ValueError, match="max_learners"):
        AutoTuner(start=5, max_learners=4)
    with pytest.raises(ValueError, match="tune"):
        AutoTuner(tune="speed")  # type: ignore[arg-type]


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
    """The tuner's measurement: the median of the steady steps' times (a form trial's steps left out; a
    few steps stretched by another process's burst do not move it)."""
    meter = StepMeter()
    assert meter.take() is None  # no step yet: the loop falls back to the whole epoch's time
    for seconds, steady in [(5.0, False), (5.0, False), (1.0, True), (3.0, True)]:
        meter.add(seconds, steady)
    assert meter.take() == pytest.approx(2.0)
    for seconds in [1.0, 1.1, 0.9, 1.0, 9.0]:  # one step of five stretched 9x
        meter.add(seconds, True)
    assert meter.take() == pytest.approx(1.0)
    assert meter.take() is None
    meter.add(4.0, False)
    assert meter.take() is None


def test_goodput_starts_where_the_noise_scale_is_measured() -> None:
    """Crossbow's throughput tuner starts at one learner per rank; the goodput tuner at the smallest count
    whose steps measure B_noise: one where the rule averages gradients over 2+ ranks, else two."""
    assert start_count("throughput", False, 2, 8) == 1
    assert start_count("goodput", True, 2, 8) == 1  # BSP over two ranks: the ranks' mean is the big batch
    assert start_count("goodput", True, 1, 8) == 2  # one rank: its own learners must be
    assert start_count("goodput", False, 4, 8) == 2  # SMA, EASGD, LOCALSGD
    assert start_count("goodput", False, 4, 1) == 1  # never past max_learners
