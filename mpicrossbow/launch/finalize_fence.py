"""How a fault-tolerant (ULFM) Open MPI job must start: the variable that marks it, and MPI_Finalize's fence.

``mpiexec --with-ft ulfm`` marks every rank of a fault-tolerant job with ``OMPI_MCA_mpi_ft_enable``; a rank
of such a job must set :data:`NO_FINALIZE_FENCE` before MPI starts (:func:`skip_finalize_fence`, called from
:func:`~mpicrossbow.launch.world.detect_world`). It lives with the launch code, not with the elastic
communicator (:mod:`mpicrossbow.comm.ulfm`), because it acts before MPI_Init, where no communicator exists.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, MutableMapping

#: The variable ``mpiexec --with-ft ulfm`` sets in every rank (Open MPI 5).
FT_VARIABLE = "OMPI_MCA_mpi_ft_enable"

#: Open MPI's switch that leaves out MPI_Finalize's PMIx fence over all the job's ranks, the dead included.
NO_FINALIZE_FENCE = "OMPI_MCA_async_mpi_finalize"


def fault_tolerant_job(environ: Mapping[str, str]) -> bool:
    """Whether this process was started by ``mpiexec --with-ft ulfm`` (Open MPI sets ``FT_VARIABLE``)."""
    return environ.get(FT_VARIABLE, "").lower() in ("1", "true", "yes")


def skip_finalize_fence(environ: MutableMapping[str, str] | None = None) -> bool:
    """Before MPI_Init, in a job started with ``--with-ft ulfm``: make MPI_Finalize leave out its PMIx fence
    (``NO_FINALIZE_FENCE``; a value the user set wins). True when the job is such a job.

    Why: that fence spans every rank the job started, the dead included, and after a SIGKILL it now and then
    never completes — measured here (Open MPI 5.0.11, 4 ranks, one SIGKILLed, the 3 survivors shrink, go
    on and finish): 6 of 80 jobs hung with every survivor inside MPI_Finalize's fence, blocking or
    non-blocking collectives alike, 0 of 80 without the fence. What the fence adds — no rank leaves before
    its last messages were delivered — a run's own end gives where every rank's last operation is a
    completed collective over the survivors (an elastic run's last step ends in an agreement)."""
    environ = os.environ if environ is None else environ
    if not fault_tolerant_job(environ):
        return False
    environ.setdefault(NO_FINALIZE_FENCE, "1")
    return True


#: Seconds MPI_Finalize may take in an elastic job before the process ends itself (:func:`bound_finalize`).
FINALIZE_DEADLINE_S = 30


def bound_finalize(seconds: int = FINALIZE_DEADLINE_S) -> None:
    """Right before an elastic rank exits (its work saved, its status known): if MPI_Finalize, which runs at
    the interpreter's exit, has not returned within ``seconds``, SIGALRM ends the process.

    Why: Open MPI 5.0.11's MPI_Finalize disconnects from every job this process was connected to — a
    ``[elastic] replace`` replacement's and its survivors' — and now and then waits forever: measured here, 1
    of 4 runs of the test where a replacement dies and is replaced left the second replacement spinning in
    ``ompi_dpm_dyn_finalize`` for 9 minutes after every other rank had exited. The job had finished (its
    checkpoint and metrics written); a rank that never exits would hold its allocation to the time limit."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(seconds)
