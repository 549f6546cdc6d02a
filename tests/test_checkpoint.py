"""Checkpoints without MPI: atomic writes, safe loading, pruning, a crash during a save (a pool's state
through a checkpoint file is the pool contract's, test_pool_contract.py)."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mpicrossbow.config import InjectSection
from mpicrossbow.errors import CheckpointError
from mpicrossbow.training.checkpoints.checkpoint_files import (
    FORMAT_VERSION,
    Checkpointer,
    atomic_save,
    complete_checkpoints,
    find_resume,
    load_rank_state,
    safe_load,
)
from mpicrossbow.training.health.faults import FaultInjector, InjectedFault
from mpicrossbow.training.reporting.metrics import MetricsWriter, read_metrics

META = {"world_size": 1, "rule": "BSP", "learners": 1, "numel": 10}


def save(ck: Checkpointer, step: int, value: float = 0.0, hook: Callable[[], None] | None = None) -> Path:
    return ck.save(step, {"rank": 0, "x": torch.full((10,), value)}, META, hook)


def test_save_load_and_keep_newest(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck", 0, 1, keep=2)
    for step in (10, 20, 30):
        save(ck, step, float(step))
    names = [p.name for p in complete_checkpoints(tmp_path / "ck")]
    assert names == ["step-000000020", "step-000000030"]
    latest = find_resume("latest", [tmp_path / "ck"])
    meta, state = load_rank_state(latest, 0, META)
    assert (
        meta["step"] == 30
        and meta["version"] == FORMAT_VERSION
        and torch.equal(state["x"], torch.full((10,), 30.0))
    )
    assert find_resume(str(tmp_path / "ck" / "step-000000020"), []) == tmp_path / "ck" / "step-000000020"


def test_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, 0, 1, keep=3)
    save(ck, 10, 1.0)

    def crash() -> None:
        raise KeyboardInterrupt("killed while writing")

    with pytest.raises(KeyboardInterrupt):
        save(ck, 20, 2.0, crash)
    assert (tmp_path / "step-000000020.partial").is_dir()  # half-written, never a checkpoint
    latest = find_resume("latest", [tmp_path])
    assert latest.name == "step-000000010"
    assert torch.equal(load_rank_state(latest, 0, META)[1]["x"], torch.ones(10))
    save(ck, 20, 2.0)  # the next save cleans up and succeeds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000010", "step-000000020"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_files_are_one_clear_error(tmp_path: Path, damage: str) -> None:
    path = save(Checkpointer(tmp_path, 0, 1, keep=1), 5)
    rank = path / "rank-00000.pt"
    data = rank.read_bytes()
    rank.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": os.urandom(len(data)), "empty": b""}[damage]
    )
    with pytest.raises(CheckpointError, match=r"checkpoint file .*rank-00000.pt is truncated or corrupt"):
        load_rank_state(path, 0, META)


def test_code_in_a_checkpoint_is_never_run(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"version": FORMAT_VERSION, "x": Evil()}, f, protocol=2)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        safe_load(path, "file")
    assert not (tmp_path / "pwned").exists()


def test_other_version_and_other_job_shape_are_named(tmp_path: Path) -> None:
    atomic_save({"version": 99}, tmp_path / "v.pt")
    with pytest.raises(CheckpointError, match="format version 99; this mpicrossbow reads 1"):
        safe_load(tmp_path / "v.pt", "file")
    path = save(Checkpointer(tmp_path / "ck", 0, 1, keep=1), 5)
    with pytest.raises(CheckpointError, match="written with world_size = 1, this job has 4"):
        load_rank_state(path, 0, {**META, "world_size": 4})
    with pytest.raises(CheckpointError, match=r"rank 1's file rank-00001\.pt is missing"):
        load_rank_state(path, 1, META)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint; looked in .*nothing"):
        find_resume("latest", [tmp_path / "nothing"])
    with pytest.raises(
        CheckpointError, match=r"looked in /abs/runs/MLP-BSP-\*/checkpoints \(no such folder\)"
    ):
        find_resume("latest", [], "/abs/runs/MLP-BSP-*/checkpoints")
    with pytest.raises(CheckpointError, match="does not exist"):
        find_resume(str(tmp_path / "nowhere"), [])


def test_a_snapshot_after_an_elastic_loss_names_the_survivors_and_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """An elastic run's snapshot taken after losing start rank 2 (training/elastic/elastic_pause.py): the
    survivor's file keeps its start rank's name, ``meta.pt`` lists the lost rank, and resuming it — every
    rank, the survivors too — is one line naming the lost rank and what to do; a snapshot without ``lost``
    loads."""
    ck = Checkpointer(tmp_path / "ck", 0, 1, keep=2, file_rank=3, lost=(2,))
    path = ck.save(7, {"rank": 3, "x": torch.zeros(10)}, {**META, "world_size": 4})
    assert [f.name for f in sorted(path.glob("rank-*.pt"))] == ["rank-00003.pt"]
    assert safe_load(path / "meta.pt", "meta")["lost"] == [2]
    for rank in (2, 3):
        with pytest.raises(
            CheckpointError, match=r"after elastic training lost rank\(s\) 2: .* newest checkpoint with"
        ):
            load_rank_state(path, rank, {**META, "world_size": 4})
    whole = save(Checkpointer(tmp_path / "ck", 0, 1, keep=2), 5)
    assert "lost" not in safe_load(whole / "meta.pt", "meta")
    assert load_rank_state(whole, 0, META)[1]["rank"] == 0


def test_resuming_a_run_that_lost_a_rank_takes_its_newest_whole_checkpoint_which_pruning_keeps(
    tmp_path: Path,
) -> None:
    """An elastic run that lost start rank 2 after its step-10 snapshot goes on snapshotting the survivors
    (steps 20-50, ``keep`` = 2): pruning keeps step 10 beside the newest two, because the later ones cannot
    be resumed; ``--resume <run folder>`` and ``resume = latest`` take step 10 (a requeued job restarts
    there, not nowhere); a snapshot named as such is taken as it is (and refused on loading)."""
    directory = tmp_path / "run" / "checkpoints"
    save(Checkpointer(directory, 0, 1, keep=2), 10)
    survivors = Checkpointer(directory, 0, 1, keep=2, lost=(2,))
    for step in (20, 30, 40, 50):
        save(survivors, step)
    names = [p.name for p in complete_checkpoints(directory)]
    assert names == ["step-000000010", "step-000000040", "step-000000050"]
    whole = directory / "step-000000010"
    assert find_resume(str(tmp_path / "run"), []) == whole
    assert find_resume("latest", [directory]) == whole
    assert find_resume(str(directory / "step-000000050"), []) == directory / "step-000000050"
    assert load_rank_state(find_resume("latest", [directory]), 0, META)[0]["step"] == 10
    only_lost = tmp_path / "later" / "checkpoints"
    save(Checkpointer(only_lost, 0, 1, keep=2, lost=(1,)), 30)
    with pytest.raises(CheckpointError, match=r"lost rank\(s\) 1"):
        load_rank_state(find_resume(str(tmp_path / "later"), []), 0, META)


def test_a_run_resumed_from_an_earlier_step_keeps_and_resumes_its_own_new_checkpoints(tmp_path: Path) -> None:
    """Resumed from step 10 of a run that had reached step 30, a job with ``keep`` = 2 saves step 15: pruning
    keeps the two written last (15 and the abandoned 30), not the two highest steps (which deleted the
    step just saved), and ``resume = latest`` takes 15, the newest written."""
    directory = tmp_path / "ck"
    first = Checkpointer(directory, 0, 1, keep=3)
    for age, step in ((30, 10), (20, 20), (10, 30)):  # written 30, 20 and 10 s ago
        path = save(first, step, float(step))
        os.utime(path / "meta.pt", ns=(time.time_ns() - age * 10**9,) * 2)
    save(Checkpointer(directory, 0, 1, keep=2), 15, 15.0)
    assert [p.name for p in complete_checkpoints(directory)] == ["step-000000015", "step-000000030"]
    latest = find_resume("latest", [directory])
    assert latest.name == "step-000000015"
    assert find_resume(str(directory), []) == latest


def test_fault_injector_fires_only_for_its_rank_and_step() -> None:
    FaultInjector(InjectSection(rank=1, step=3), rank=0).at_step(3)
    injector = FaultInjector(InjectSection(rank=1, step=3), rank=1)
    injector.at_step(2)
    with pytest.raises(InjectedFault, match="step 3"):
        injector.at_step(3)
    losses, grads = [torch.zeros(())], [torch.zeros(4)]
    FaultInjector(InjectSection(rank=0, step=1, action="nan"), 0).poison(1, losses, grads)
    assert torch.isnan(losses[0]) and torch.isnan(grads[0]).all()
    assert FaultInjector(InjectSection(rank=0, step=5, action="kill_in_save"), 0).in_save(4) is None


def test_a_serving_rank_fails_once_it_has_answered_step_requests() -> None:
    """A parameter server takes no steps: ``[inject] step`` counts the requests it answered, and the fault
    fires once (a signal drill asked between every sweep would otherwise repeat)."""
    injector = FaultInjector(InjectSection(rank=0, step=30), rank=0)
    injector.at_served(29)
    with pytest.raises(InjectedFault, match="step 30"):
        injector.at_served(31)  # a sweep may answer several requests: at or past the count
    injector.at_served(40)
    FaultInjector(InjectSection(rank=0, step=30, action="nan"), rank=0).at_served(30)  # a step's own actions


def test_resuming_beside_damaged_metrics_keeps_them_and_starts_new_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank killed in the middle of an HDF5 write leaves metrics.h5 unreadable: the resumed run keeps it,
    renamed, and writes a new one instead of failing to resume."""
    path = tmp_path / "metrics.h5"
    first = MetricsWriter(path, "cfg")
    first.train(step=10, epoch=0, loss=1.0, accuracy=0.5, lr=0.1, time=1.0, learners=1, data_wait=0.0)
    first.close()
    damaged = path.read_bytes()
    path.write_bytes(damaged[:64] + bytes(len(damaged) - 64))  # header kept, object headers zeroed
    writer = MetricsWriter(path, "cfg", resume_step=10)
    writer.train(step=20, epoch=1, loss=0.5, accuracy=0.8, lr=0.1, time=2.0, learners=1, data_wait=0.0)
    writer.close()
    kept = tmp_path / "metrics.h5.damaged-step-10"
    assert kept.read_bytes() == damaged[:64] + bytes(len(damaged) - 64)  # nothing of it lost
    assert list(read_metrics(path)["train"]["step"]) == [20.0]
    assert "kept as metrics.h5.damaged-step-10" in caplog.text
