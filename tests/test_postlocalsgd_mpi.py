"""POSTLOCALSGD through ``crossbow-launch``'s real path: a run killed after the switch and resumed from a
checkpoint on either side of it ends bitwise equal to an uninterrupted run.

The digits job on 2 ranks for 2 epochs of 44 steps: BSP for the first epoch, SMA from step 44; checkpoints
every 20 steps, rank 1 fails at step 70. Resumed from step 40 the run crosses the switch again; resumed from
step 60 (the newest) it restores SMA's phase and state.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import launcher, only_run, run_mpi
from mpicrossbow.training.checkpoints.checkpoint_files import complete_checkpoints

pytestmark = [pytest.mark.mpi]

STEPS, SWITCH = 88, 44  # 2 epochs of 44 steps on 2 ranks; the switch after the first
RULE = ("RULE=POSTLOCALSGD", "rule.then=SMA", "rule.switch_epoch=1")


def job(mpiexec: str, out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """The digits job under POSTLOCALSGD on 2 ranks, checkpoints every 20 steps, with ``overrides``."""
    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={out}", "session.epochs=2",
            "checkpoint.every_steps=20", *RULE, *overrides]  # fmt: skip
    return run_mpi(mpiexec, 2, args, timeout=90)


def final_state(out: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state in the run's last checkpoint, taken after the last step."""
    final = complete_checkpoints(only_run(out) / "checkpoints")[-1]
    assert final.name == f"step-{STEPS:09d}"
    return torch.load(final / f"rank-{rank:05d}.pt", weights_only=True)


def assert_same(a: Any, b: Any, where: str) -> None:
    """``a == b``, tensors bit for bit, through nested dicts and lists."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_a_run_killed_after_the_switch_resumes_bitwise_equal_from_either_side(
    mpiexec: str, tmp_path: Path
) -> None:
    whole, before, after = tmp_path / "whole", tmp_path / "before", tmp_path / "after"
    done = job(mpiexec, whole)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"switched from BSP to SMA at step {SWITCH} (epoch 1)" in done.stderr
    crashed = job(mpiexec, before, "inject.rank=1", "inject.step=70")
    assert crashed.returncode != 0 and "rank 1 of 2" in crashed.stderr
    shutil.copytree(before, after)
    checkpoints = only_run(before) / "checkpoints"
    assert [p.name for p in complete_checkpoints(checkpoints)] == [f"step-{s:09d}" for s in (20, 40, 60)]
    crossing = job(mpiexec, before, f"checkpoint.resume={checkpoints / 'step-000000040'}")
    assert crossing.returncode == 0, crossing.stderr[-3000:]
    assert f"switched from BSP to SMA at step {SWITCH}" in crossing.stderr
    restored = job(mpiexec, after, "--resume")
    assert restored.returncode == 0, restored.stderr[-3000:]
    assert "step-000000060 (step 60)" in restored.stderr and "switched from BSP" not in restored.stderr
    for rank in (0, 1):
        reference = final_state(whole, rank)
        assert reference["rule"]["switched_at"] == SWITCH and "z" in reference["rule"]["then"]
        for resumed in (before, after):
            state = final_state(resumed, rank)
            assert_same(reference["pool"], state["pool"], f"{resumed.name} rank {rank} pool")
            assert_same(reference["rule"], state["rule"], f"{resumed.name} rank {rank} rule")
