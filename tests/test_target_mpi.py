"""``[session] target_accuracy`` with ``validate_every`` fractions under real ``mpiexec``: a 2-rank BSP digits
run validates four times an epoch and stops at the first validation at or above the target, on every rank
at the same step, with the time and epochs to it in metrics.h5 (tests/mpi_scripts/digits_runs.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from conftest import only_run, run_mpi
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.mpi]

SCRIPTS = Path(__file__).parent / "mpi_scripts"


def test_training_stops_at_the_target_accuracy(mpiexec: str, tmp_path: Path) -> None:
    """Stopped within the epoch budget at a quarter-epoch validation, the last validation at the target."""
    args = [
        sys.executable,
        str(SCRIPTS / "digits_runs.py"),
        str(tmp_path),
        "BSP=RULE=BSP,session.epochs=30,session.validate_every=0.25,session.target_accuracy=0.9",
    ]
    proc = run_mpi(mpiexec, 2, args, timeout=180)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path / "BSP") / "metrics.h5")
    attrs = metrics["attrs"]
    epochs = float(attrs["target_epochs"])
    assert 0 < epochs < 30 and not math.isnan(float(attrs["target_seconds"])), attrs
    steps = int(attrs["steps"])
    per_epoch = round(steps / epochs)
    assert math.isclose(steps / per_epoch, epochs), (steps, epochs)
    assert steps % per_epoch % round(per_epoch / 4) == 0, f"step {steps} is no quarter-epoch validation"
    assert float(attrs["val_accuracy"]) >= 0.9 and int(attrs["epochs"]) <= math.ceil(epochs), attrs
    assert "target accuracy 0.9000 reached" in proc.stderr
