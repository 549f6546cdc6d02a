"""Preemption and requeue under Slurm: a job stopped by a signal comes back by itself and carries on.

* **Stopping.** SIGUSR1/SIGTERM before the time limit makes every rank save a checkpoint at the same step
  (:mod:`.signals`). Then rank 0 asks Slurm to requeue the job (``scontrol requeue $SLURM_JOB_ID``) when
  ``[checkpoint] requeue`` says so — ``auto``: when the job is requeueable (``sbatch --requeue``) — and every
  rank exits with :data:`~mpicrossbow.errors.STOPPED_EXIT_CODE` (75), never 0: the run is not finished, and
  ``--dependency=afterok`` chains must not go on.
* **Coming back.** A requeued job starts with ``SLURM_RESTART_COUNT`` ≥ 1 and the same job id. It resumes
  from the newest complete checkpoint of the run folder this job id wrote (its ``session.cfg`` records
  ``slurm_job_id``), continuing in that folder — also when ``[checkpoint] resume`` names an older checkpoint
  (the one the job's first run started from: going back to it would throw away what the job trained since).
  When the job wrote none yet, ``[checkpoint] resume`` is read as at the first start, else it starts from
  the beginning.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from ...config import Config
from ...errors import STOPPED_EXIT_CODE
from ...launch.slurm import SlurmJob
from ...launch.world import World

log = logging.getLogger(__name__)


def after_signal_stop(world: World, config: Config, run_dir: Path) -> int:
    """Rank 0 requeues the job (or says how to continue); every rank returns the stopped exit status."""
    # Requeueing sends SIGTERM to every rank: ignored from here, so each rank still finalizes MPI (which
    # removes MPICH's shared-memory segment; one left behind, named after the job and step, breaks the
    # requeued job's MPI_Init) and exits with the stopped status.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    world.bcast(None)
    if world.rank == 0:
        requeue(config, SlurmJob.from_env(), run_dir)
    world.bcast(None)  # nobody exits (srun --kill-on-bad-exit ends the step) before rank 0 asked Slurm
    return STOPPED_EXIT_CODE


def requeue(config: Config, job: SlurmJob | None, run_dir: Path) -> bool:
    """Requeue ``job`` if ``[checkpoint] requeue`` asks for it; True when Slurm took the request."""
    setting = config.checkpoint.requeue
    later = f"resume it with checkpoint.resume={run_dir} (or --resume {run_dir})"
    if job is None or setting is False:
        why = "not under Slurm" if job is None else "[checkpoint] requeue = false"
        log.warning("not finished (exit status %d, %s): %s", STOPPED_EXIT_CODE, why, later)
        return False
    if setting == "auto" and not job.requeueable():
        log.warning(
            "not finished (exit status %d): Slurm job %s is not requeueable (sbatch --requeue); %s",
            STOPPED_EXIT_CODE,
            job.job_id,
            later,
        )
        return False
    # Said before asking: Slurm ends the run as it takes the request, and under Open MPI its mpiexec, ended
    # too, drops what the ranks write after that (a fresh-clone CI lost the line said after the request).
    log.warning("requeueing Slurm job %s: it resumes from this checkpoint in %s", job.job_id, run_dir)
    error = job.requeue()
    if error is not None:
        log.error("could not requeue Slurm job %s (%s): %s", job.job_id, error, later)
        return False
    return True


def automatic_resume(config: Config, job: SlurmJob | None) -> bool:
    """Whether this run is a requeued Slurm job that resumes by itself from the newest checkpoint it wrote
    (before ``[checkpoint] resume``, which names where the job's first run started)."""
    return job is not None and job.restart_count > 0 and config.checkpoint.requeue is not False


def written_by(run_dir: Path, job: SlurmJob) -> bool:
    """Whether ``run_dir``'s session.cfg records Slurm job ``job`` (an earlier start of this same job)."""
    try:
        head = (run_dir / "session.cfg").read_text(encoding="utf-8").split("\n\n", 1)[0]
    except OSError:
        return False
    return f"# slurm_job_id = {job.job_id}" in head.splitlines()
