"""The sbatch templates of launch/slurm run the digits job on a real Slurm: one node and two emulated nodes.

The cluster (munged, slurmctld, slurmd n1 and n2) is private to the test session (tests/slurm_cluster.py);
jobs are waited for with a bounded poll and cancelled on timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)

from conftest import REPO, mpi_env
from mpicrossbow.training.metrics import read_metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TEMPLATES = REPO / "launch" / "slurm"


def job_env(runs: Path) -> dict[str, str]:
    """What sbatch exports to the job: this environment's Python and MPI first on PATH, repo importable."""
    env = mpi_env({"RUNS": str(runs)})
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.mark.parametrize(
    ("template", "nodes", "launcher"),
    [
        ("one-node.sbatch", 1, "srun"),
        ("multi-node.sbatch", 2, "srun"),
        ("multi-node-mpiexec.sbatch", 2, "mpiexec"),
    ],
)
def test_sbatch_template_trains_digits_to_95_percent(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    template: str,
    nodes: int,
    launcher: str,
) -> None:
    runs = tmp_path / "runs"
    # Emulated nodes share the machine's cores: without --exclusive both would hand out "their" core 0.
    exclusive = ["--exclusive"] if nodes > 1 else []
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/slurm-%j.out",
        *exclusive,
        str(TEMPLATES / template),
        cwd=REPO,
        env=job_env(runs),
    )
    record = slurm_cluster.wait_job(job, timeout=300)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert record["JobState"] == "COMPLETED", out[-3000:]
    assert record["NumNodes"] == str(nodes) and record["NumTasks"] == "2"
    (run,) = (runs / str(job)).iterdir()  # output folder per job id
    metrics = read_metrics(run / "metrics.h5")
    assert metrics["attrs"]["world_size"] == 2
    assert metrics["val"]["accuracy"][-1] >= 0.95, metrics["val"]["accuracy"]
    table = out.split("bindings:\n", 1)[1].splitlines()[:3]
    assert [row.split()[-1] for row in table[1:]] == ["core", "core"]
    assert len({row.split()[3] for row in table[1:]}) == 2  # two ranks, two different cores


def test_templates_are_valid_bash_and_document_checkpoint_on_signal() -> None:
    for path in sorted(TEMPLATES.glob("*.sbatch")):
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (path.name, proc.stderr)
        text = path.read_text()
        assert "#SBATCH --output=slurm-%j.out" in text and "$RUNS/$SLURM_JOB_ID" in text
        assert "#SBATCH --signal=USR1@" in text and "checkpoint.resume=" in text
    assert "--gpus-per-node=8" in (TEMPLATES / "gpu-nodes.sbatch").read_text()
