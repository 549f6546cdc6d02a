"""When the loop validates and when it stops at a target accuracy (mpicrossbow/training/run/validations.py):
the cadence of ``[session] validate_every`` (whole epochs, or fractions within one), the training clock that
leaves validation out, and the first validation at or above ``[session] target_accuracy``."""

from __future__ import annotations

import time

import pytest

from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.launch.failure import agree
from mpicrossbow.launch.world import World
from mpicrossbow.training.run.session import Session
from mpicrossbow.training.run.validations import Validations


def scripted(accuracies: list[float], seconds: float = 0.0) -> Validations:
    """Validations whose validate() returns the next accuracy, taking ``seconds``; target 0.9, every 0.25."""
    values = iter(accuracies)

    def validate() -> tuple[float, float]:
        time.sleep(seconds)
        return 1.0, next(values)

    return Validations(validate, 0.25, 0.9)


def test_fractions_validate_within_the_epoch_and_at_its_end() -> None:
    checks = Validations(lambda: (0.0, 0.0), 0.25, 0.0)
    assert [n for n in range(1, 21) if checks.due_within_epoch(n, 20)] == [5, 10, 15]  # 20: the end's
    assert checks.due_at_epoch_end(0, last=False)
    # 10 batches: a quarter rounds to 2 (every 2nd batch), never more than once a batch
    assert [n for n in range(1, 11) if checks.due_within_epoch(n, 10)] == [2, 4, 6, 8]
    assert all(Validations(lambda: (0.0, 0.0), 0.01, 0.0).due_within_epoch(n, 10) for n in range(1, 10))


def test_whole_epochs_validate_every_nth_epoch_and_after_the_last() -> None:
    checks = Validations(lambda: (0.0, 0.0), 3, 0.0)
    assert not any(checks.due_within_epoch(n, 20) for n in range(1, 21))
    assert [e for e in range(9) if checks.due_at_epoch_end(e, last=False)] == [2, 5, 8]
    assert checks.due_at_epoch_end(3, last=True)
    never = Validations(lambda: (0.0, 0.0), 0, 0.0)
    assert not never.due_at_epoch_end(0, last=False) and never.due_at_epoch_end(0, last=True)


def test_the_first_validation_at_the_target_is_kept_and_ends_training() -> None:
    checks = scripted([0.5, 0.89, 0.9, 0.95])
    checks.start()
    for step, epochs in ((10, 0.25), (20, 0.5)):
        checks.run(step, epochs)
        assert not checks.done and checks.reached is None
    assert checks.run(30, 0.75) == (1.0, 0.9)
    assert checks.done and checks.reached is not None and checks.reached[1] == 0.75
    assert checks.run(30, 0.75) == (1.0, 0.9), "the same step is validated once"
    checks.run(40, 1.0)
    assert checks.reached[1] == 0.75, "a later, better validation does not move the time to target"
    assert [(e, a) for _, e, a in checks.curve] == [(0.25, 0.5), (0.5, 0.89), (0.75, 0.9), (1.0, 0.95)]


def test_the_training_clock_leaves_validation_out() -> None:
    checks = scripted([0.95], seconds=0.2)
    checks.start()
    checks.run(1, 0.1)
    assert checks.reached is not None and checks.reached[0] < 0.1
    assert checks.training_seconds < 0.1


def test_settings_are_checked() -> None:
    base = ["DEVICES=cpu0"]
    quarter = load_config("launch/digits.cfg", [*base, "session.validate_every=0.25"])
    assert quarter.session.validate_every == 0.25
    with pytest.raises(ConfigError, match="whole number of epochs"):
        load_config("launch/digits.cfg", [*base, "session.validate_every=1.5"])
    with pytest.raises(ConfigError, match="target_accuracy"):
        load_config("launch/digits.cfg", [*base, "session.target_accuracy=94"])


def test_a_target_needs_a_synchronous_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """Asynchronous ranks have no common step to stop at: one clear error before training."""
    world = World(rank=0, size=1, local_rank=0, local_size=1, node=0, nodes=1, hostname="h", launcher=None)
    cfg = load_config("launch/digits.cfg", ["DEVICES=cpu0", "RULE=GOSGD", "session.target_accuracy=0.9"])
    assert agree(world, Session(cfg, world).prepare_local) == 2
    err = capsys.readouterr().err
    assert "[session] target_accuracy needs a synchronous rule" in err and "RULE=GOSGD" in err, err


def test_the_device_work_queued_before_a_validation_counts_as_training() -> None:
    """On CUDA the steps run after the host queued them: the clock pauses only once ``settle`` waited for
    them, so an asynchronous device's training is not booked as validation."""
    waited: list[float] = []

    def settle() -> None:  # a device still busy with queued steps for 50 ms
        time.sleep(0.05)
        waited.append(time.perf_counter())

    def validate() -> tuple[float, float]:
        time.sleep(0.05)
        return 0.1, 0.5

    checks = Validations(validate, 0.25, 0.0, settle)
    checks.start()
    checks.run(4, 0.25)
    assert len(waited) == 1 and 0.05 <= checks.training_seconds < 0.095
    checks.run(4, 0.25)  # the same step: neither validated nor settled again
    assert len(waited) == 1
