"""Learning-rate schedule: warm-up, step and multistep, evaluated at fractional epochs."""

from __future__ import annotations

import pytest

from mpicrossbow.config import OptimSection
from mpicrossbow.training.schedule import lr_at


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
