"""The quick tier, ``pytest -m quick``: the in-process tests, for the inner loop (a few minutes on 2 cores).

A test is ``quick`` unless it is marked ``mpi``, ``slow``, ``slurm``, ``cluster`` or ``cuda`` (those launch
jobs, start daemons or need hardware): the marker is given here at collection, so a new unit test joins the
tier by itself. A unit test that takes seconds is marked ``slow`` where it is written, and leaves the tier.

The tier must touch every module of the package: a run of exactly ``-m quick`` that passed ends by listing
the modules of ``mpicrossbow`` that no quick test imported, and fails when there is one (a module only
subprocesses reach needs a unit test, or its name in :data:`REACHED_ELSEWHERE` with the reason).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from parallel import IMPORTED_BY_WORKERS, in_worker

#: Markers that keep a test out of the quick tier.
OUTSIDE = ("mpi", "slow", "slurm", "cluster", "cuda")
PACKAGE = Path(__file__).resolve().parent.parent / "mpicrossbow"
#: Modules the quick tier need not import, each with the reason.
REACHED_ELSEWHERE: dict[str, str] = {
    "mpicrossbow.comm.torchdist": (
        "torch.distributed's communicator needs a process group of real ranks: the communicator contract's "
        "gloo and gloo-staged cases run it under mpiexec (tests/test_communicator_contract.py)"
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that carries none of :data:`OUTSIDE` as ``quick``."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in OUTSIDE):
            item.add_marker(pytest.mark.quick)


def package_modules() -> list[str]:
    """Every module of the package, by dotted name (``__init__`` files as their package)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def untouched() -> list[str]:
    """The package's modules this process has not imported, less :data:`REACHED_ELSEWHERE`."""
    imported = set(sys.modules) | IMPORTED_BY_WORKERS  # a distributed run: the workers' imports (parallel.py)
    return [m for m in package_modules() if m not in imported and m not in REACHED_ELSEWHERE]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After a passing ``-m quick`` run: fail when a module of the package went untouched."""
    if session.config.getoption("markexpr", "") != "quick" or exitstatus != 0 or in_worker(session.config):
        return  # (on several workers the controller checks the union of their imports)
    missing = untouched()
    if missing:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"quick tier: {len(missing)} module(s) of mpicrossbow no quick test imports: "
                + ", ".join(missing),
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
