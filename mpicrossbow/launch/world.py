"""Who am I: the launcher that started this process, and rank, size and local rank from MPI itself.

Launch detection reads the variables each launcher sets (Open MPI's ``mpirun``, MPICH's Hydra ``mpiexec``,
Slurm ``srun`` with PMI-2 or PMIx). The local rank comes from MPI's shared-memory split
(``Split_type(COMM_TYPE_SHARED)``), never from one launcher's variables, so it is right under all of them.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, TypeVar

from .fabric_probe import skip_fabric_probe
from .finalize_fence import skip_finalize_fence

#: Variables that prove an MPI launcher (or srun with a PMI plug-in) started this process.
LAUNCHER_VARIABLES: dict[str, tuple[str, ...]] = {
    "openmpi": ("OMPI_COMM_WORLD_SIZE",),
    "pmix": ("PMIX_RANK",),
    "mpich": ("PMI_RANK", "PMI_SIZE"),
}


def detect_launcher(environ: dict[str, str] | None = None) -> str | None:
    """Name of the launcher that started this process (``openmpi``, ``pmix``, ``mpich``), or None if plain."""
    environ = dict(os.environ) if environ is None else environ
    for name, keys in LAUNCHER_VARIABLES.items():
        if all(k in environ for k in keys):
            if name == "mpich" and "SLURM_STEP_ID" in environ:
                return "slurm-pmi2"
            if name == "pmix" and "SLURM_STEP_ID" in environ:
                return "slurm-pmix"
            return name
    return None


#: Settings that make waiting ranks give the CPU back instead of spinning (as mpi4py's CI uses them). With
#: more ranks than cores, a spinning rank steals the time slice of the rank everybody waits for: measured
#: here, 4 ranks on 2 cores trained the digits job in 59 s without them and in 1 s with them. A yield alone
#: (``sched_yield``) still leaves the waiting rank runnable, and the kernel shares the core evenly between it
#: and the working ones; each yield is a nanosleep instead (MPICH's heavy yield, Open MPI's ``nanosleep``
#: yield strategy): 4 ranks on 2 cores, 3 of them waiting 3 s in ``MPI_Barrier``, burnt 0.33x the CPU
#: (Open MPI 0.35x) and a busy process beside them ran in 0.65x the time (Open MPI 0.95x), while the digits
#: job's ordinary steps took 1.02x (both; benchmarks/mpi_yield.py, benchmarks/results/mpi_yield.md).
OVERSUBSCRIBED_SETTINGS = {
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_threads_pthreads_yield_strategy": "nanosleep",
}


def local_ranks_from_launcher(environ: dict[str, str]) -> int | None:
    """Ranks on this node as the launcher announces them (before MPI is initialised), if it does."""
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE"):
        value = environ.get(key, "").split("(")[0].split(",")[0]
        if value.isdigit():
            return int(value)
    return None


def tune_for_oversubscription(environ: dict[str, str] | None = None) -> bool:
    """Before MPI_Init: with more ranks on this node than CPUs, make idle ranks yield (user settings win)."""
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    local = local_ranks_from_launcher(environ)  # type: ignore[arg-type]
    if local is None or local <= (os.cpu_count() or 1):
        return False
    for key, value in OVERSUBSCRIBED_SETTINGS.items():
        environ.setdefault(key, value)
    return True


def launcher_rank(environ: dict[str, str] | None = None) -> int | None:
    """This process's world rank as the launcher announces it, read before MPI is initialised."""
    environ = dict(os.environ) if environ is None else environ
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return None


T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    nodes: int
    hostname: str
    launcher: str | None
    mpi: Any = None  # the mpi4py COMM_WORLD, None in a plain single process without MPI
    #: The torch device this rank drives, once chosen (``xb.init``); None before.
    device: Any = None

    def allgather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order (a collective; ``[value]`` without MPI)."""
        return self.mpi.allgather(value) if self.mpi is not None else [value]

    def bcast(self, value: T, root: int = 0) -> T:
        """Rank ``root``'s ``value`` on every rank (a collective; ``value`` itself without MPI)."""
        return self.mpi.bcast(value, root=root) if self.mpi is not None else value


class WorldView:
    """The run's world as it is now: one object every part that gathers or reports reads (the loop's parts,
    reporting, evaluation, checkpoints), so elastic training moves the world on in one place when a rank is
    lost or a replacement joins, instead of pushing a copy into each part."""

    def __init__(self, world: World) -> None:
        #: The world now (rank, size and communicator of the current members).
        self.now = world


class FollowsWorld:
    """A part that reads the world from the run's shared :class:`WorldView` (given one, or a World of its
    own); setting ``world`` moves the shared view on."""

    view: WorldView

    def follow(self, world: World | WorldView) -> None:
        """Read the world from ``world`` (a shared view), or from a view of its own over a World."""
        self.view = world if isinstance(world, WorldView) else WorldView(world)

    @property
    def world(self) -> World:
        """The world now."""
        return self.view.now

    @world.setter
    def world(self, world: World) -> None:
        self.view.now = world


def mpi_threads_ok(world: World) -> bool:
    """Whether MPI was started with ``MPI_THREAD_MULTIPLE`` (True in a single process without MPI)."""
    if world.mpi is None:
        return True
    from mpi4py import MPI

    return bool(MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


def detect_world(threads: bool = False) -> World:
    """Initialise MPI (thread level ``serialized``; ``multiple`` with ``threads``: a rule talks MPI from a
    second thread) and describe this rank's place in COMM_WORLD. MPI starts once per process: the first
    call's level stays."""
    import mpi4py

    mpi4py.rc.thread_level = "multiple" if threads else "serialized"
    oversubscribed = tune_for_oversubscription()
    skip_finalize_fence()  # under --with-ft ulfm: a dead rank must not hold up MPI_Finalize
    skip_fabric_probe()  # Open MPI on one node: its libfabric transport only costs MPI_Init a second
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    leaders = comm.Split(0 if local.rank == 0 else MPI.UNDEFINED, comm.rank)
    node = comm.rank if leaders == MPI.COMM_NULL else leaders.rank
    nodes = 0 if leaders == MPI.COMM_NULL else leaders.size
    node = local.bcast(node, root=0)
    nodes = comm.bcast(nodes, root=0)
    world = World(
        rank=comm.rank,
        size=comm.size,
        local_rank=local.rank,
        local_size=local.size,
        node=node,
        nodes=nodes,
        hostname=socket.gethostname(),
        launcher=detect_launcher(),
        mpi=comm,
    )
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    local.Free()
    if oversubscribed and world.rank == 0:
        logging.getLogger(__name__).info("more ranks than cores on a node: idle ranks yield the CPU")
    return world
