"""benchmarks/epochs_to_target.py's reading of a run's metrics: the epochs to each of several targets from one
run's validations, fractional (metrics.h5's ``val`` rows carry the epoch's index, which rounded 29.25 to 30),
and the tables it writes."""

from __future__ import annotations

import math

import pytest

from benchmarks.epochs_to_target import first_at, fractional_epochs, noise_table, run_noise_scale, tables

pytestmark = pytest.mark.quick


def test_each_target_is_read_at_its_first_validation_in_fractional_epochs() -> None:
    # 8 steps an epoch (the first train row's step), a validation every 2 steps
    epochs = fractional_epochs([2, 4, 6, 8, 10, 12], [8, 16])
    assert epochs == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5]
    accuracy = [0.5, 0.79, 0.81, 0.78, 0.86, 0.95]
    assert first_at(epochs, accuracy, 0.8) == 0.75  # the first at or above, not a later one
    assert first_at(epochs, accuracy, 0.85) == 1.25
    assert first_at(epochs, accuracy, 0.95) == 1.5  # at, not only above
    assert math.isnan(first_at(epochs, accuracy, 0.96))  # missed
    assert all(math.isnan(e) for e in fractional_epochs([2, 4], []))  # ended within its first epoch


def test_the_tables_give_each_target_and_each_rule_relative_to_bsp() -> None:
    nan = math.nan
    results = {
        4: {0.8: {"SMA": [10.0, 12.0, 11.0], "BSP": [5.0, 5.5, 6.0]},
            0.9: {"SMA": [30.0, nan, nan], "BSP": [10.0, 10.0, 10.0]}},
    }  # fmt: skip
    text = tables(results, [4], [0.8, 0.9])
    assert "**to 80%**" in text and "**to 90%**" in text
    assert "| SMA | 11.0 (3/3) |" in text and "| SMA | 30.0 (1/3) |" in text
    assert "| SMA, 80% | 2.00 |" in text and "| SMA, 90% | 3.00 |" in text  # medians over BSP's median
    assert "| BSP, 80%" not in text
    assert "relative to BSP" not in tables(results, [4], [0.8])  # one target: its table alone


def test_the_noise_scale_is_each_runs_median_then_the_seeds_median_in_samples_and_batches() -> None:
    nan = math.nan
    assert run_noise_scale([nan, 40.0, 100.0, 60.0]) == 60.0  # epochs it was not measured are left out
    assert math.isnan(run_noise_scale([nan, nan]))
    noise = {
        2: {"SMA (x)": [nan, nan], "BSP (x)": [30.0, 50.0, nan]},
        4: {"SMA (x)": [nan, 320.0], "BSP (x)": [64.0, 64.0, 80.0]},
    }
    rows = noise_table(noise, [2, 4], batch=16).splitlines()[-2:]
    assert rows == ["| SMA (x) | not measured | 320 (20.0 b) |", "| BSP (x) | 40 (2.5 b) | 64 (4.0 b) |"]
