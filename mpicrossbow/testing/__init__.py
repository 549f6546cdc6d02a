"""Test doubles: threads as ranks, for mpicrossbow's tests and for users who test their own rules. Not for
training.

A real job runs one process per rank under ``mpiexec``; these run every rank as a thread of one process,
so a rule's exact arithmetic, or its recovery from a lost rank, is checked in a plain ``pytest`` run
without MPI:

* :class:`InProcessWorld` (:mod:`.inprocess`): ``InProcessWorld(4).run(fn)`` calls ``fn(comm)`` on four
  threads, each with an :class:`InProcessCommunicator`, and returns the results in rank order. Collectives
  reduce in rank order, so a numpy reference adding in that order matches bit for bit.
* ``FaultyWorld`` (import it from :mod:`.fault_double`, the package's one module that knows a rank can be
  lost): the same for elastic training, each thread given a ``FaultyGroup`` (a fault-tolerant group as
  ULFM's is) whose rank can die on demand.

Training never imports this package: the session builds its communicators in :mod:`mpicrossbow.comm`.
"""

from .inprocess import InProcessCommunicator, InProcessWorld, WorldAborted

__all__ = ["InProcessCommunicator", "InProcessWorld", "WorldAborted"]
