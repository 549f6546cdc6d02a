"""Before MPI_Init, in an Open MPI job whose ranks are all on this node: leave out the libfabric transport.

Open MPI's ``ofi`` byte-transfer layer (``btl/ofi``, libfabric) probes the node's network interfaces in
``MPI_Init`` and then sleeps a whole second (``clock_nanosleep`` of 1 s, seen with strace) before it gives
up on a machine without a fabric for it: every rank of every Open MPI job started a second late here (the
PyPI wheel, Open MPI 5.0.11, which the elastic runs need), and so did every replacement rank an elastic run
spawns. Between ranks of one node that transport has nothing to do: Open MPI moves their messages through
shared memory (``btl/sm``) and their one-sided windows through ``osc/sm``. So when the launcher says the
job's ranks are all here (``OMPI_COMM_WORLD_LOCAL_SIZE`` equals ``OMPI_COMM_WORLD_SIZE``),
:func:`skip_fabric_probe` sets ``OMPI_MCA_btl=^ofi`` for this rank. A job across nodes keeps every
transport (a fabric's own path, ``pml/cm`` with ``mtl/ofi``, is not a BTL and is never touched), and a
``btl`` setting the user gave (``--mca btl``, which Open MPI hands each rank as ``OMPI_MCA_btl``, or the
variable) wins. A replacement rank (``MPI_Comm_spawn``) is a job of one to Open MPI, so it always leaves the
layer out: in a job across nodes it then reaches its peers by ``btl/tcp`` (or the fabric's ``pml``), not
by ``btl/ofi`` (what its parents pass it, :mod:`~mpicrossbow.training.elastic.replacement`, does not carry
their choice yet). Measured here: ``MPI_Init`` 1.07 s -> 0.08 s a rank; the 1-epoch digits job on 2 ranks
3.28 s -> 2.23 s (benchmarks/results/startup.md, 2026-12-02 05:51).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: Open MPI's variable for the byte-transfer layers a rank may use.
BTL_VARIABLE = "OMPI_MCA_btl"
#: Every layer but libfabric's.
WITHOUT_OFI = "^ofi"


def skip_fabric_probe(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set :data:`BTL_VARIABLE` to :data:`WITHOUT_OFI` when this Open MPI rank's job lives on this node
    alone and nothing set it yet; True when it did."""
    environ = os.environ if environ is None else environ
    size, local = environ.get("OMPI_COMM_WORLD_SIZE", ""), environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if not (size.isdigit() and size == local) or BTL_VARIABLE in environ:
        return False
    environ[BTL_VARIABLE] = WITHOUT_OFI
    return True
