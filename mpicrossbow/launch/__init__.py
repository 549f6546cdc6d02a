"""Launching: who this process is (MPI, Slurm, a plain process), its device, its cores, starting the job when
no MPI launcher did (and removing what its MPI left in ``/dev/shm``), and the failure protocol (agree on bad
input, abort with the rank named).

Nothing here knows a rule's equations or imports torch at module level: ``crossbow-launch`` run alone goes
through these modules on its way to ``mpiexec``/``srun``.
"""
