"""torchvision's own models by name, in the second environment where torchvision imports.

torchvision does not import beside the CPU torch this project pins (``operator torchvision::nms does not
exist``); the pair that does here is torch 2.14.1 + torchvision 0.29.1, a 5.6 GB CUDA build that installs in
about 90 s. ``.ci/run`` makes it as ``.venv-torchvision`` (with mpicrossbow installed) when the disk has room;
``CROSSBOW_TORCHVISION_VENV`` names another. Without it these tests skip, saying why.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, mpi_env, only_run
from mpicrossbow.data.shapes import make_shapes

VENV = Path(os.environ.get("CROSSBOW_TORCHVISION_VENV", REPO / ".venv-torchvision"))

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        not (VENV / "bin" / "crossbow-launch").exists(),
        reason=f"no torchvision environment at {VENV} (.ci/run makes it: torch 2.14.1 + torchvision 0.29.1)",
    ),
]


def test_the_zoo_matches_torchvision_there(tmp_path: Path) -> None:
    """tests/test_zoo.py in that environment: its comparisons with torchvision run instead of skipping."""
    python = str(VENV / "bin" / "python")
    proc = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/test_zoo.py"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def test_a_torchvision_model_trains_by_name(tmp_path: Path) -> None:
    """MODELFILE=torchvision.models, MODELCLASS=resnet18, [model] num_classes: 2 ranks on generated images."""
    folder = make_shapes(tmp_path / "shapes", per_class_train=16, per_class_val=4, size=64, classes=4, seed=0)
    args = [
        str(VENV / "bin" / "mpiexec"), "-n", "2", str(VENV / "bin" / "crossbow-launch"),
        "-cfg", "launch/resnet18_shapes.cfg", "MODELFILE=torchvision.models", "MODELCLASS=resnet18",
        f"dataset.root={folder}", f"session.output={tmp_path / 'runs'}", "session.steps=2",
        "data.batch_size=8",
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch model resnet18 from torchvision.models" in proc.stderr
    assert (only_run(tmp_path / "runs") / "metrics.h5").is_file()
