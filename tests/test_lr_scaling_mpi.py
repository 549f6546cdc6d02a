"""``[optim] lr_scaling`` through crossbow-launch's own path: the rate every epoch trains at is ``lr × k``
(linear) for k = ranks × learners per rank, also while ``learners = auto`` changes k between epochs, and the
run's session.cfg records the scaling."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_mpi
from mpicrossbow.training.reporting.metrics import read_metrics

SCRIPTS = REPO / "tests" / "mpi_scripts"
LR = 0.01
COMMON = [
    "RULE=SMA",
    f"optim.lr={LR}",
    "optim.lr_scaling=linear",
    "optim.lr_cap=1.0",  # far above LR x k: the rate is LR x k, which the test reads
    "optim.schedule=none",
    "optim.warmup_epochs=0",
    "session.epochs=3",
    "session.validate_every=0",
]


@pytest.mark.mpi
@pytest.mark.slow
def test_every_epoch_trains_at_lr_times_the_learners_in_all(mpiexec: str, tmp_path: Path) -> None:
    runs = [
        "m1=launch/digits.cfg,pool.learners=1",
        "m3=launch/digits.cfg,pool.learners=3",
        "auto=launch/digits.cfg,pool.learners=auto,pool.max_learners=3,pool.tune_threshold=0",
    ]
    args = [sys.executable, str(SCRIPTS / "cfg_runs.py"), str(tmp_path), *runs, "--", *COMMON]
    proc = run_mpi(mpiexec, 2, args, timeout=240)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    for label, learners in (("m1", 1), ("m3", 3), ("auto", None)):
        (run,) = (tmp_path / label).iterdir()
        train = read_metrics(run / "metrics.h5")["train"]
        counts = train["learners"] if learners is None else np.full(3, learners)
        np.testing.assert_allclose(train["lr"], LR * 2 * counts, rtol=1e-6)  # 2 ranks × learners
        assert "lr_scaling = linear" in (run / "session.cfg").read_text(encoding="utf-8")
