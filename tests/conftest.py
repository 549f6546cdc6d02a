"""Shared test fixtures: the environment's own MPI launcher, a bounded way to run MPI jobs, and the step loop
of in-process rule tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mpicrossbow.training.step import train_step

REPO = Path(__file__).resolve().parent.parent


def find_mpiexec() -> str | None:
    """The launcher of the MPI that mpi4py in this environment uses: next to sys.executable, then PATH."""
    here = Path(sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        if (here / name).exists():
            return str(here / name)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for MPI subprocesses: repo importable, Open MPI allowed as root and oversubscribed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_btl", "^ofi")
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


@pytest.fixture(scope="session")
def mpiexec() -> str:
    """Path of the MPI launcher; skips the test where no MPI is installed."""
    path = find_mpiexec()
    if path is None:
        pytest.skip("no mpiexec found next to the Python interpreter or on PATH")
    return path


def run_mpi(
    mpiexec: str,
    n: int,
    args: list[str],
    timeout: float = 120,
    cwd: Path | str = REPO,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n n args...`` with a hard timeout; the caller asserts on returncode and output."""
    return subprocess.run(
        [mpiexec, "-n", str(n), *args],
        cwd=cwd,
        env=mpi_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def verdicts(stdout: str) -> dict[str, str]:
    """``{check name: "OK" | "SKIP ..." | "FAIL ..."}`` from the ``CHECK`` lines of an MPI check script
    (tests/mpi_scripts/verdicts.py)."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, verdict = line.split(" ", 2)
            found[name] = verdict
    return found


#: World sizes of the communicator jobs (:func:`comm_job`).
COMM_JOB_SIZES = (1, 2, 3, 4)


@dataclass(frozen=True)
class CommJob:
    """What one launch of the communicator checks printed and returned (``returncode`` None: timed out)."""

    n: int
    returncode: int | None
    stdout: str
    stderr: str

    def verdicts(self, label: str) -> dict[str, str]:
        """``{check: verdict}`` of the checks reported as ``<label>.<check>``."""
        prefix = f"{label}."
        return {k[len(prefix) :]: v for k, v in verdicts(self.stdout).items() if k.startswith(prefix)}

    def tail(self) -> str:
        """The exit status and the end of stderr, for an assertion message."""
        return f"\n(mpiexec -n {self.n}: rc={self.returncode})\n{self.stderr[-4000:]}"


@pytest.fixture(scope="session")
def comm_job(mpiexec: str) -> Callable[[int], CommJob]:
    """``comm_job(n)``: the one ``mpiexec -n n`` launch (made on first use, then shared by every test of the
    session) of tests/test_communicator_contract.py, which runs the communicator contract on every MPI-based
    implementation and then the MPI- and shared-memory-specific checks of tests/mpi_scripts/mpi_check.py and
    shm_check.py: importing torch costs seconds per rank, so the comm tests share four launches."""
    jobs: dict[int, CommJob] = {}
    script = REPO / "tests" / "test_communicator_contract.py"

    def job(n: int) -> CommJob:
        if n not in jobs:
            args = [sys.executable, str(script), "--also", "mpi_check", "--also", "shm_check"]
            try:
                proc = run_mpi(mpiexec, n, args, timeout=300)
                jobs[n] = CommJob(n, proc.returncode, proc.stdout, proc.stderr)
            except subprocess.TimeoutExpired as exc:
                out, err = (x.decode() if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr))
                jobs[n] = CommJob(n, None, out, f"{err}\ntimed out after {exc.timeout}s")
        return jobs[n]

    return job


def launcher() -> list[str]:
    """The installed ``crossbow-launch`` console script, or the module when the package is not installed."""
    script = Path(sys.executable).parent / "crossbow-launch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mpicrossbow.cli"]


def only_run(out: Path) -> Path:
    """The one run folder a job created under ``out``."""
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def train_steps(pool: Any, rule: Any, steps: int, sleep_s: float = 0.0) -> list[np.ndarray]:
    """The session's step loop without the session, for in-process rule tests: each epoch started as it
    begins, then :func:`~mpicrossbow.training.step.train_step`, then ``sleep_s`` (a test's straggler).
    Returns every step's gradients as the rule received them, ``(learners, P)`` arrays: what the
    differential tests replay in numpy."""
    per_epoch = pool.n_batch_train
    grads: list[np.ndarray] = []

    def record(step: int) -> None:
        grads.append(np.stack([learner.grads.numpy().copy() for learner in pool.learners]))

    for step in range(steps):
        if step % per_epoch == 0:
            pool.start_epoch(step // per_epoch)
        train_step(pool, rule, step, guard=record)
        time.sleep(sleep_s)
    return grads
