"""How the suite runs on two workers (pytest-xdist, ``-n 2``, the README's command).

Many tests mostly wait: on Slurm's scheduler, on a peer timeout, on a rank slowed on purpose. Run one after
another they leave the machine's cores idle for about a third of the suite; on two workers another test uses
that time. :class:`GroupScheduling` hands the workers whole groups of tests, never single tests, because some
things must not be split or doubled:

* **one group per test file**: a module's shared fixture (a job or a cluster made once for the module's tests)
  stays made once;
* **the daemons' group**: the files of :data:`DAEMON_FILES` (every test marked ``slurm`` or ``cluster``, but
  one that stays in its file), on one worker, first: they share the session's private Slurm and namespace
  nodes, made once per worker, and are the longest group, so starting them first keeps the end short;
  the in-process files of :data:`MOSTLY_WAITING` join it: beside the other worker's jobs they cost a core
  little, where in the in-process tail, after the jobs, their waits held a worker (37 s of waits);
* **the communicator group**: the files that share the communicator contract's four ``mpiexec`` launches
  (:func:`conftest.comm_job`).

Two workers' torch computations share the cores: each worker, and every job it starts, gets
``OMP_NUM_THREADS`` = cores / workers (unless set already). With a thread per core in every process,
OpenMP's threads wait for each other at every parallel region while the other worker holds the core: two
one-process trainings at once took 4.4x their time alone here (benchmarks/shared_cores.py), and a 4-second
example ran past its 120 s timeout on the CI machine.

The two workers' MPI jobs take the cores in turn (:mod:`core_slots`): a test marked ``mpi`` outside the
daemons' group holds every core while it runs, so one worker's job never runs beside the other's (two
CPU-bound jobs on two cores took 4x their time alone and more; stop 60's CI timed out on one), while the
daemons' group and the in-process tests go on beside it.

The groups go by file name because the controller sees test ids only; a worker refuses to start when a test
marked ``slurm`` or ``cluster`` sits in a file the table does not know. The quick tier's check that it touches
every module (:mod:`quick_tier`) needs every worker's imports: each worker sends the package's modules it
imported back in ``workeroutput``, and the controller takes their union.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from mpicrossbow.launch.world import OVERSUBSCRIBED_SETTINGS

#: Markers of the tests that need the session's daemons (Slurm, namespace nodes).
DAEMON_MARKERS = ("slurm", "cluster")
#: The files of the daemons' group.
DAEMON_FILES = ("test_slurm.py", "test_slurm_netns.py", "test_cluster_netns.py", "test_embedded_slurm.py")
#: In-process files whose tests mostly wait (a peer's timeout, a grace period, a fake srun that hangs, a
#: re-measure timer), measured alone: about 37 s of their wall is waiting, 12 s is CPU. They run in the
#: daemons' group, beside the MPI jobs, not in the in-process tail after them.
MOSTLY_WAITING = (
    "test_auto.py",
    "test_bounded.py",
    "test_elastic_template.py",
    "test_groups_template.py",
    "test_lost_hosts.py",
    "test_peer_watch.py",
    "test_rendezvous.py",
    "test_signals.py",
)
#: Files with a daemons' test that runs in its own file's group: its cluster is its own (a command of
#: docs/cluster.md starting one), and it shares nothing with the daemons' group.
DAEMONS_ELSEWHERE = ("test_docs_commands.py",)
#: Files that share one session fixture, and their group.
SHARED = {
    "test_communicator_contract.py": "communicator",
    "test_comm_mpi.py": "communicator",
    "test_comm_shm.py": "communicator",
}
#: Modules of the package that the workers imported (the controller's union, from ``workeroutput``).
IMPORTED_BY_WORKERS: set[str] = set()


#: The environment :func:`pytest_configure` gives the workers, so every job they start inherits it.
SHARING_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", *OVERSUBSCRIBED_SETTINGS)


def sharing_env() -> dict[str, str]:
    """This process's core-sharing settings (:data:`SHARING_KEYS` that are set: by :func:`pytest_configure`
    or the user), for a job whose environment is built from scratch (a Slurm cluster's clients, a fresh
    login shell's): without them its ranks spin in every MPI wait and start a thread per core beside the
    other worker's test (a lost-node test's survivors burnt 43 CPU s in 53 s, measured alone)."""
    return {key: os.environ[key] for key in SHARING_KEYS if key in os.environ}


def group_of(nodeid: str) -> str:
    """The group of the test ``nodeid``: the daemons' (with the mostly waiting files), a shared fixture's, or
    its file's."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return "daemons" if name in DAEMON_FILES or name in MOSTLY_WAITING else SHARED.get(name, name)


def in_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker."""
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """In the controller of N workers, before they start: they and their jobs inherit ``OMP_NUM_THREADS``
    = cores // N (torch reads it as it starts; mpicrossbow's ranks keep it, see its launch.binding), and
    the settings that make a rank waiting in MPI sleep between its polls (``OVERSUBSCRIBED_SETTINGS``, which
    crossbow-launch gives a node with more ranks than cores): the workers' jobs share the cores with each
    other's even when each has no more ranks than cores, and a rank spinning in an allreduce while a
    slowed peer sleeps, or while a replacement starts, took the core from the other worker's test."""
    workers = config.getoption("numprocesses", default=None)
    if in_worker(config) or not isinstance(workers, int) or workers < 2:
        return
    per = str(max(1, len(os.sched_getaffinity(0)) // workers))
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(key, per)
    for key, value in OVERSUBSCRIBED_SETTINGS.items():
        os.environ.setdefault(key, value)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The controller's scheduler, for any ``--dist`` that balances load (``-n 2`` alone is ``load``)."""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """Whole groups (:func:`group_of`) to a worker at a time, in collection order (daemons first)."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: refuse a daemons' test outside the daemons' files, and order the groups by
    :func:`order_of` (every worker collects the same tests in the same order, as xdist requires; within
    each kind the groups keep their order)."""
    if not in_worker(config):
        return
    known = (*DAEMON_FILES, *DAEMONS_ELSEWHERE)
    strays = sorted(
        {
            item.path.name
            for item in items
            if any(item.get_closest_marker(m) for m in DAEMON_MARKERS) and item.path.name not in known
        }
    )
    if strays:
        raise pytest.UsageError(
            f"{', '.join(strays)}: tests marked slurm or cluster in a file that tests/parallel.py's "
            "DAEMON_FILES does not list (two workers would each start the daemons): add the file there"
        )
    with_jobs = {group_of(item.nodeid) for item in items if item.get_closest_marker("mpi")}
    items.sort(key=lambda item: order_of(group_of(item.nodeid), with_jobs))


def order_of(group: str, with_jobs: set[str]) -> int:
    """Where ``group`` goes in the workers' queue: the daemons' group first (on one worker, the longest),
    then the groups with MPI jobs (the other worker runs them meanwhile; they take the cores in turn, and
    are the suite's critical path), the in-process groups last: they fill both workers once the jobs are
    done instead of slowing the jobs beside them (taking them first after the daemons cost 29:13 against
    26:31 in a fresh-clone CI)."""
    return 0 if group == "daemons" else 1 if group in with_jobs else 2


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In a worker: report the package's modules this process imported."""
    if in_worker(session.config):
        workeroutput: dict[str, Any] = session.config.workeroutput  # type: ignore[attr-defined]
        workeroutput["imported"] = sorted(m for m in sys.modules if m.startswith("mpicrossbow"))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """In the controller: collect what a finished worker imported."""
    IMPORTED_BY_WORKERS.update(getattr(node, "workeroutput", {}).get("imported", ()))
