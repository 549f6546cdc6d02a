"""The embedded API under Slurm's own launcher: ``srun --mpi=pmi2 -n 2 python examples/train_digits.py``
trains as one job; ``srun`` without PMI (each task would train alone) is one line and status 2."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)

from conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
VENV = Path(sys.executable).parent.parent


def srun(cluster: SlurmCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """``srun args`` from the test's fresh environment with this virtual environment first on PATH."""
    env = cluster.fresh_env()
    env["PATH"] = f"{VENV}/bin:{env['PATH']}"
    return subprocess.run(["srun", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_srun_with_pmi_runs_the_example_as_one_job(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    proc = srun(slurm_cluster, "--mpi=pmi2", "-n", "2", "python", "examples/train_digits.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # srun forwards each rank's output in chunks: two ranks' lines may share a line of stdout
    tests = re.findall(r"Test: average loss [\d.]+, accuracy \d+/\d+ \([\d.]+%\)", proc.stdout)
    assert len(tests) == 2 and tests[0] == tests[1], proc.stdout[-2000:]
    assert "[rank 0/2]" in proc.stderr, "not one job of two ranks"


def test_srun_without_pmi_is_one_line_and_status_2(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    start = time.monotonic()
    proc = srun(slurm_cluster, "--mpi=none", "-n", "2", "python", "examples/train_digits.py")
    assert time.monotonic() - start < 30
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpicrossbow: error: ")]
    assert proc.returncode == 2, proc.stderr
    assert lines == [
        "mpicrossbow: error: srun started 2 tasks without a PMI plug-in, so each would run alone: "
        "run srun --mpi=pmi2 (this MPI is MPICH); 'srun --mpi=list' shows what this Slurm offers"
    ], proc.stderr
