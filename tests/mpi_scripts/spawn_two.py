"""Run under Open MPI's mpiexec on 2 ranks, the survivors: both start two replacements in one spawn, as after
two ranks were lost together (``spawn_replacements``, each on this host); each survivor and each replacement
prints the size of the merged communicator. A replacement is this script again, ``REPLACES`` set."""

import os
import sys

from mpi4py import MPI

from mpicrossbow.training.elastic.replacement import REPLACES, spawn_replacements

if REPLACES in os.environ:
    merged = MPI.Comm.Get_parent().Merge(high=True)
    print(f"replacement of start rank {os.environ[REPLACES]}: merged {merged.Get_size()}", flush=True)
else:
    host = MPI.Get_processor_name()
    merged = spawn_replacements(MPI.COMM_WORLD, (2, 3), (host, host))
    size = None if merged is None else merged.Get_size()
    print(f"survivor {MPI.COMM_WORLD.Get_rank()}: merged {size}", flush=True)
if merged is not None:
    merged.Barrier()
# MPI_Finalize after a spawn crashes in Open MPI 5.0's dynamic-process teardown (ompi_dpm_dyn_finalize, a
# segfault in opal_net_get_hostname); what is tested ended at the barrier
sys.stdout.flush()
os._exit(0)
