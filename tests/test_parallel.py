"""The suite's groups on two workers (tests/parallel.py): the daemons' tests stay together, and the files that
share the communicator contract's launches too."""

from __future__ import annotations

import re
from pathlib import Path

from parallel import DAEMON_FILES, DAEMONS_ELSEWHERE, MOSTLY_WAITING, SHARED, group_of, order_of

TESTS = Path(__file__).resolve().parent


def test_the_daemons_files_are_one_group_and_every_other_file_its_own() -> None:
    assert {group_of(f"tests/{name}::test_x[a-b]") for name in DAEMON_FILES} == {"daemons"}
    assert {group_of(f"tests/{name}::test_x") for name in MOSTLY_WAITING} == {"daemons"}
    assert {group_of(f"tests/{name}::test_x") for name in SHARED} == {"communicator"}
    assert group_of("tests/test_bsp.py::test_x[1-2]") == "test_bsp.py"
    assert group_of("tests/test_bsp.py::test_y") == group_of("tests/test_bsp.py::test_x")


def test_every_file_with_slurm_or_cluster_tests_is_in_the_table() -> None:
    """A new file of Slurm or namespace-node tests must join the daemons' group, or two workers would each
    start the daemons (a worker refuses to start then too; this says so without starting one)."""
    marked = {
        path.name
        for path in TESTS.glob("test_*.py")
        if re.search(r"pytest\.mark\.(slurm|cluster)\b", path.read_text(encoding="utf-8"))
    }
    assert marked == set(DAEMON_FILES) | set(DAEMONS_ELSEWHERE)


def test_the_mostly_waiting_files_start_no_mpi_job() -> None:
    """The daemons' group takes no core slots (tests/core_slots.py): an MPI test there would run beside the
    other worker's job."""
    for name in MOSTLY_WAITING:
        text = (TESTS / name).read_text(encoding="utf-8")
        assert not re.search(r"pytest\.mark\.mpi\b|run_mpi\(", text), name


def test_the_queue_runs_the_daemons_then_the_jobs_then_the_in_process_groups() -> None:
    """The jobs (one at a time: the critical path) before the in-process groups, which fill both workers
    at the end."""
    groups = ["test_config.py", "test_bsp.py", "daemons", "test_pool.py", "test_localsgd.py"]
    with_jobs = {"test_bsp.py", "test_localsgd.py"}
    queue = sorted(groups, key=lambda g: order_of(g, with_jobs))
    assert queue == ["daemons", "test_bsp.py", "test_localsgd.py", "test_config.py", "test_pool.py"]
