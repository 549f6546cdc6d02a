"""Learning-rate schedule: warm-up, step and multistep, evaluated at fractional epochs."""

from __future__ import annotations

import pytest

from mpicrossbow.config import OptimSection
from mpicrossbow.training.run.schedule import lr_at, lr_scale


def test_constant_by_default() -> None:
    assert lr_at(OptimSection(lr=0.5), 0.0) == lr_at(OptimSection(lr=0.5), 99.9) == 0.5


def test_step_and_multistep() -> None:
    step = OptimSection(lr=1.0, schedule="step", step_epochs=2, gamma=0.5)
    assert [lr_at(step, e) for e in (0, 1.9, 2, 4.5)] == [1.0, 1.0, 0.5, 0.25]
    multi = OptimSection(lr=1.0, schedule="multistep", milestones=(3, 5), gamma=0.1)
    assert [lr_at(multi, e) for e in (2.99, 3, 4.9, 5)] == pytest.approx([1.0, 0.1, 0.1, 0.01])


def test_linear_warmup_from_a_tenth() -> None:
    warm = OptimSection(lr=1.0, warmup_epochs=2)
    assert [lr_at(warm, e) for e in (0, 1, 2, 3)] == pytest.approx([0.1, 0.55, 1.0, 1.0])


def test_lr_scaling_multiplies_the_peak_by_1_sqrt_k_or_k() -> None:
    for scaling, factor in (("none", 1.0), ("sqrt", 4.0), ("linear", 16.0)):
        optim = OptimSection(lr=0.025, lr_scaling=scaling)
        assert lr_at(optim, 3.0, learners=16) == pytest.approx(0.025 * factor)
        assert lr_at(optim, 3.0) == pytest.approx(0.025)  # one learner: lr as written


def test_the_warm_up_rises_from_a_tenth_of_the_unscaled_lr_to_the_scaled_peak() -> None:
    warm = OptimSection(lr=0.1, lr_scaling="linear", warmup_epochs=2)
    assert [lr_at(warm, e, learners=8) for e in (0, 1, 2, 3)] == pytest.approx([0.01, 0.405, 0.8, 0.8])


def test_the_decay_applies_to_the_scaled_rate() -> None:
    multi = OptimSection(lr=0.1, lr_scaling="sqrt", schedule="multistep", milestones=(3,), gamma=0.1)
    assert [lr_at(multi, e, learners=4) for e in (2.9, 3)] == pytest.approx([0.2, 0.02])


def test_bad_scalings_and_learner_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="lr_scaling"):
        lr_scale("cubic", 4)
    with pytest.raises(ValueError, match="learners = 0"):
        lr_scale("linear", 0)


def test_lr_cap_bounds_the_scaled_peak_and_its_decay() -> None:
    """linear scaling with lr_cap 0.2: k x 0.025 up to k = 8, then 0.2 (one learner of batch 16 diverges
    past it on MNIST-1D however many average); the decay and the warm-up's end follow the capped peak."""
    optim = OptimSection(lr=0.025, lr_scaling="linear", lr_cap=0.2, schedule="multistep", milestones=(10,))
    assert [lr_at(optim, 5.0, k) for k in (4, 8, 16, 32)] == pytest.approx([0.1, 0.2, 0.2, 0.2])
    assert lr_at(optim, 10.0, 16) == pytest.approx(0.02)
    warm = OptimSection(lr=0.025, lr_scaling="linear", lr_cap=0.2, warmup_epochs=2)
    assert lr_at(warm, 1.0, 16) == pytest.approx((0.0025 + 0.2) / 2)


def test_an_lr_cap_below_lr_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lr_cap = 0\.01 is below lr = 0\.1"):
        OptimSection(lr=0.1, lr_cap=0.01)
