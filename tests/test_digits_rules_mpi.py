"""Every 4-rank rule of the digits job (tests/digits_rules.py) under real ``mpiexec -n 4``: each reaches the
4-rank target (93 %) with nothing in flight at exit, in one launch whose runs go one after another
(tests/mpi_scripts/digits_runs.py, the launcher's own ``run_rank``), so torch starts once per rank instead
of once per rule (issue 51: a rank's start costs about 2.4 CPU seconds, a digits run here about 1), on the
shared short schedule (``DIGITS_SHORT``: 10 epochs).

Besides the shared table's rules, the parameter server's settings that only this test runs: GSP with
explicit groups and shares (the slow rank 3 alone, with a smaller share of the data), and ASGD with two
server ranks and two learners per worker. What each rule must do beyond training is its own file's test
(against numpy, in process); the crossbow-launch command line under ``mpiexec -n 4`` is test_launch_mpi's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from digits_rules import DIGITS_EPOCHS, DIGITS_RULES, DIGITS_SHORT, DIGITS_TARGET

from conftest import only_run, run_mpi
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.mpi]

SCRIPTS = Path(__file__).parent / "mpi_scripts"
#: label → overrides (``{groups}``, ``{shares}``: files the fixture writes) of every run of the launch.
RUNS = {
    **DIGITS_RULES[4],
    "GSP-groups-shares": "RULE=GSP,rule.groups={groups},rule.shares={shares},"
    "session.slow_ranks=3,session.slow_factor=2",
    "ASGD-2servers-2learners": "RULE=ASGD,rule.servers=2,pool.learners=2",
}


@pytest.fixture(scope="module")
def digits_runs(mpiexec: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The one ``mpiexec -n 4`` launch of every run of :data:`RUNS`: (its output folder, its stderr)."""
    out = tmp_path_factory.mktemp("digits4")
    groups, shares = out / "groups.txt", out / "shares.txt"
    groups.write_text("1 2\n3\n")  # the slow rank 3 alone, with a smaller share of the data
    shares.write_text("0 0\n0 0.4\n0.4 0.8\n0.8 1\n")
    runs = [f"{label}={spec.format(groups=groups, shares=shares)}" for label, spec in RUNS.items()]
    args = [sys.executable, str(SCRIPTS / "digits_runs.py"), str(out), *runs, "--", *DIGITS_SHORT]
    proc = run_mpi(mpiexec, 4, args, timeout=120 * len(runs))
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stdout[-1000:] + proc.stderr[-3000:]
    return out, proc.stderr


@pytest.mark.parametrize("label", list(RUNS))
def test_every_rule_reaches_the_four_rank_digits_target(digits_runs: tuple[Path, str], label: str) -> None:
    out, _ = digits_runs
    metrics = read_metrics(only_run(out / label) / "metrics.h5")
    accuracy = metrics["val"]["accuracy"]
    assert accuracy[-1] >= DIGITS_TARGET[4], accuracy
    assert metrics["attrs"]["world_size"] == 4
    assert list(metrics["attrs"]["rank_in_flight"]) == [0, 0, 0, 0]
    # the run's epochs and steps (its done: line's), also where rank 0 serves and trains none
    assert metrics["attrs"]["epochs"] == DIGITS_EPOCHS and metrics["attrs"]["steps"] > 0, metrics["attrs"]
    if label in ("GOSGD", "EASGD-async"):  # every rank's own model scored (gossip, a centre and workers)
        assert len(metrics["attrs"]["rank_val_accuracy"]) == 4


def test_no_rule_imports_the_compiler(digits_runs: tuple[Path, str]) -> None:
    """Every rank built and stepped its optimizers through every rule and none compiled: none imported
    torch._dynamo (about a second of each rank's start: mpicrossbow.dynamo_on_demand)."""
    _, log = digits_runs
    assert "COMPILER imported on ranks []" in log, log[-2000:]


def test_the_asynchronous_easgd_centre_reports_about_once_an_epoch(digits_runs: tuple[Path, str]) -> None:
    """EASGD's centre rank reported the centre's accuracy about once per epoch, then the final model, and
    said so in its log."""
    out, log = digits_runs
    metrics = read_metrics(only_run(out / "EASGD-async") / "metrics.h5")
    assert len(metrics["val"]["accuracy"]) >= DIGITS_EPOCHS, metrics["val"]["accuracy"]
    assert "EASGD server:" in log and "all done" in log
