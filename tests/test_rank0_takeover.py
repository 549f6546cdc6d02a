"""Rank 0's duties passing to the lowest survivor when elastic training loses rank 0 (issue 40), without MPI:
metrics.h5 reopened with every epoch once, a half-written row dropped, the checkpoint lock taken over. The
job itself is in tests/test_elastic_mpi.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mpicrossbow.config import load_config
from mpicrossbow.launch.world import World
from mpicrossbow.training.checkpoints.checkpoint_lock import LOCK
from mpicrossbow.training.reporting.metrics import read_metrics
from mpicrossbow.training.reporting.reporting import Reporter

RANK0 = World(rank=0, size=4, local_rank=0, local_size=4, node=0, nodes=1, hostname="h", launcher=None)
RANK1 = dataclasses.replace(RANK0, rank=1, local_rank=1)


def report(reporter: Reporter, epoch: int, step: int) -> None:
    """Reporter.epoch for 0-based ``epoch`` ending at ``step``, validated."""
    reporter.epoch(epoch, step, 0.05, 1, (1.0 / (epoch + 1), 0.5), (0.9, 0.8), (0.0, 0.0))


def reporters(tmp_path: Path) -> tuple[Reporter, Reporter]:
    """Rank 0's reporter and rank 1's over one run folder (no MPI: each alone)."""
    config = load_config("launch/digits.cfg")
    return Reporter(config, RANK0, tmp_path, None), Reporter(config, RANK1, tmp_path, None)


def test_a_survivor_writes_the_epoch_rank_0_died_before_writing_and_no_epoch_twice(tmp_path: Path) -> None:
    """Rank 0 wrote epoch 1 and died after the ranks agreed on epoch 2's figures, before writing them: the
    survivor that becomes rank 0 reopens metrics.h5, writes epoch 2 from the rows every rank keeps, and the
    file then holds epochs 1, 2, 3 once each; the start's world size stays the file's."""
    first, second = reporters(tmp_path)
    report(first, 0, 22)
    report(second, 0, 22)
    report(second, 1, 44)  # rank 0 is dead by now: it never writes epoch 2
    first.metrics.file.close()  # type: ignore[union-attr]  # what its death leaves: a flushed file
    second.world = dataclasses.replace(RANK1, rank=0, size=3)
    assert second.take_over(44) == 2
    report(second, 2, 66)
    second.close()
    metrics = read_metrics(tmp_path / "metrics.h5")
    assert list(metrics["train"]["epoch"]) == [1, 2, 3]
    assert list(metrics["val"]["epoch"]) == [1, 2, 3]
    assert metrics["attrs"]["rank0_lost_at_step"] == 44 and metrics["attrs"]["world_size"] == 4


def test_an_epoch_rank_0_wrote_before_dying_is_not_written_again(tmp_path: Path) -> None:
    first, second = reporters(tmp_path)
    for reporter in (first, second):
        report(reporter, 0, 22)
        report(reporter, 1, 44)
    first.metrics.file.close()  # type: ignore[union-attr]
    second.world = dataclasses.replace(RANK1, rank=0, size=3)
    assert second.take_over(44) == 2
    second.close()
    assert list(read_metrics(tmp_path / "metrics.h5")["train"]["epoch"]) == [1, 2]


def test_a_row_rank_0_was_killed_in_the_middle_of_is_dropped_and_written_whole(tmp_path: Path) -> None:
    """Killed between two columns of epoch 2's train row: the columns differ in length; the survivor keeps
    the whole rows only and writes epoch 2 whole."""
    first, second = reporters(tmp_path)
    report(first, 0, 22)
    report(second, 0, 22)
    report(second, 1, 44)
    train = first.metrics.file["train"]  # type: ignore[union-attr]
    for column in ("step", "epoch", "loss"):  # part of a row
        train[column].resize((2,))
        train[column][-1] = 44 if column == "step" else 2
    first.metrics.file.close()  # type: ignore[union-attr]
    second.world = dataclasses.replace(RANK1, rank=0, size=3)
    second.take_over(44)
    second.close()
    metrics = read_metrics(tmp_path / "metrics.h5")
    assert list(metrics["train"]["epoch"]) == [1, 2]
    assert list(metrics["train"]["loss"]) == [1.0, 0.5]
    assert all(len(column) == 2 for column in metrics["train"].values())


def test_the_survivor_takes_the_dead_rank_0s_checkpoint_lock(tmp_path: Path) -> None:
    """The lock names a process on another host (nothing here can tell it is gone): elastic training knows
    it is, so the new rank 0 takes the lock, and gives it up at the end."""
    from mpicrossbow.training.checkpoints.checkpoint_manager import CheckpointManager

    config = load_config("launch/digits.cfg", ["checkpoint.every_epochs=1"])
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    owner = {"host": "elsewhere", "pid": 1, "started": 1, "boot": "b", "pidns": "p", "job": "", "since": 0.0}
    (directory / LOCK).write_text(json.dumps(owner), encoding="utf-8")

    class NoPool:
        """The pool CheckpointManager is given; the lock needs none of it."""

    checkpoints = CheckpointManager(config, dataclasses.replace(RANK1, mpi=None), NoPool(), "cpu")  # type: ignore[arg-type]
    checkpoints.start(tmp_path)
    assert checkpoints.lock is None  # rank 1 holds no lock
    checkpoints.world = dataclasses.replace(RANK1, rank=0, size=3)
    assert checkpoints.take_over()
    assert json.loads((directory / LOCK).read_text(encoding="utf-8"))["host"] != "elsewhere"
    checkpoints.close()
    assert not (directory / LOCK).exists()
