"""What Slurm tells a job about itself, and the two things a job asks Slurm: may I be requeued, requeue me.

Read from the variables Slurm sets (``SLURM_JOB_ID``, ``SLURM_ARRAY_*``, ``SLURM_JOB_NODELIST``,
``SLURM_RESTART_COUNT``, ...); the questions go through ``scontrol`` with a timeout, so a slow or absent
controller costs seconds and an error line, never a hang.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

#: Seconds an ``scontrol`` call may take before it counts as failed.
SCONTROL_TIMEOUT_S = 30


def in_slurm_allocation(environ: Mapping[str, str] | None = None) -> bool:
    """True inside ``sbatch``/``salloc`` (a job id) but outside a job step started by ``srun``."""
    environ = os.environ if environ is None else environ
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" not in environ


def srun_tasks_without_pmi(environ: Mapping[str, str] | None = None) -> int:
    """Tasks of the ``srun`` step this process belongs to when that step has no PMI (0 otherwise).

    ``srun -n 2`` without ``--mpi=pmi2``/``pmix`` (the default on many clusters) starts tasks that each see
    an MPI world of one: every one would train alone, or start its own ``mpiexec``.
    """
    environ = os.environ if environ is None else environ
    if "SLURM_STEP_ID" not in environ:
        return 0
    if any(k in environ for k in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_FD")):
        return 0
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    return int(tasks) if tasks.isdigit() and int(tasks) > 1 else 0


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job this process runs in: what a run records about where and when it ran."""

    job_id: str
    array_job_id: str
    array_task_id: str
    nodelist: str
    restart_count: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SlurmJob | None:
        """The job from Slurm's variables, or None outside Slurm."""
        environ = os.environ if environ is None else environ
        job = environ.get("SLURM_JOB_ID", "")
        if not job:
            return None
        restarts = environ.get("SLURM_RESTART_COUNT", "0")
        return cls(
            job_id=job,
            array_job_id=environ.get("SLURM_ARRAY_JOB_ID", ""),
            array_task_id=environ.get("SLURM_ARRAY_TASK_ID", ""),
            nodelist=environ.get("SLURM_JOB_NODELIST", environ.get("SLURM_NODELIST", "")),
            restart_count=int(restarts) if restarts.isdigit() else 0,
        )

    def record(self) -> dict[str, str | int]:
        """``slurm_*`` attributes for metrics.h5 and the resolved session.cfg (empty fields left out)."""
        fields = {
            "slurm_job_id": self.job_id,
            "slurm_array_job_id": self.array_job_id,
            "slurm_array_task_id": self.array_task_id,
            "slurm_nodelist": self.nodelist,
            "slurm_restart_count": self.restart_count,
        }
        return {k: v for k, v in fields.items() if v != ""}

    def _scontrol(self, *args: str) -> tuple[bool, str]:
        scontrol = shutil.which("scontrol")
        if scontrol is None:
            return False, "scontrol is not on PATH"
        try:
            proc = subprocess.run(
                [scontrol, *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return False, f"scontrol {' '.join(args)}: {exc}"
        if proc.returncode != 0:
            return False, f"scontrol {' '.join(args)}: {(proc.stderr or proc.stdout).strip()}"
        return True, proc.stdout

    def requeueable(self) -> bool:
        """Whether Slurm would requeue this job (``Requeue=1``: ``sbatch --requeue`` or the site default)."""
        ok, out = self._scontrol("-o", "show", "job", self.job_id)
        return ok and "Requeue=1" in out.split()

    def requeue(self) -> str | None:
        """Ask Slurm to requeue this job (it ends this run and starts again later); the error, or None."""
        ok, out = self._scontrol("requeue", self.job_id)
        return None if ok else out
