"""Elastic training's pieces without MPI jobs: the setting, its resolution, the launcher's flag, the rule
hook (issue 40). The jobs themselves are in tests/test_elastic_mpi.py."""

from __future__ import annotations

import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import run_local
from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.launch.devices import parse_devices
from mpicrossbow.launch.failure import ERROR_PREFIX
from mpicrossbow.launch.finalize_fence import FT_VARIABLE, NO_FINALIZE_FENCE, skip_finalize_fence
from mpicrossbow.launch.spawn import spawn_command
from mpicrossbow.launch.world import World
from mpicrossbow.rules.base import Rule
from mpicrossbow.rules.registry import resolve
from mpicrossbow.training.elastic import run_tolerance
from mpicrossbow.training.elastic.run_tolerance import resolve_elastic

WORLD = World(rank=0, size=2, local_rank=0, local_size=2, node=0, nodes=1, hostname="h", launcher="x", mpi=1)


def digits(*overrides: str) -> tuple[Rule, object]:
    """The digits job's resolved rule and config with ``overrides``."""
    rule, config = resolve(load_config("launch/digits.cfg", list(overrides)))
    return rule, config


def test_elastic_is_off_by_default_and_reads_true_false_auto() -> None:
    assert load_config("launch/digits.cfg").elastic.enabled is False
    assert load_config("launch/digits.cfg", ["elastic.enabled=true"]).elastic.enabled is True
    assert load_config("launch/digits.cfg", ["elastic.enabled=auto"]).elastic.enabled == "auto"
    with pytest.raises(ConfigError, match="elastic"):
        load_config("launch/digits.cfg", ["elastic.enabled=maybe"])
    with pytest.raises(ConfigError, match="min_ranks"):
        load_config("launch/digits.cfg", ["elastic.min_ranks=0"])


def test_crossbow_launch_starts_open_mpi_with_ulfm_only_when_elastic() -> None:
    devices = parse_devices("cpu0,cpu1")
    assert spawn_command("m", "openmpi", devices, [], fault_tolerant=True)[:8] == [
        "m", "-n", "2", "--with-ft", "ulfm", "--prtemca", "state_base_recoverable", "1",
    ]  # fmt: skip
    assert "--with-ft" not in spawn_command("m", "openmpi", devices, [])
    assert "--with-ft" not in spawn_command("m", "mpich", devices, [], fault_tolerant=True)


def test_false_never_asks_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> str:
        raise AssertionError("asked")

    monkeypatch.setattr(run_tolerance, "ulfm_missing", fail)
    rule, config = digits()
    assert resolve_elastic(config, rule, WORLD) is False  # type: ignore[arg-type]


def test_true_without_ulfm_is_a_config_error_saying_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_tolerance, "ulfm_missing", lambda: "this MPI (MPICH) has no ULFM: install it")
    rule, config = digits("elastic.enabled=true")
    with pytest.raises(ConfigError, match=r"\[elastic\] enabled = true: this MPI \(MPICH\) has no ULFM"):
        resolve_elastic(config, rule, WORLD)  # type: ignore[arg-type]
    rule, config = digits("elastic.enabled=auto")
    assert resolve_elastic(config, rule, WORLD) is False  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("comm.backend=gloo",), "backend = gloo cannot shrink"),
        (("RULE=GSP", "rule.groups=auto"), r"RULE=GSP with \[rule\] groups = auto is not elastic"),
        (("RULE=SSP", "rule.placement=colocated", "checkpoint.on_signal=false"), "cannot forget"),
    ],
)
def test_what_elastic_cannot_follow_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, overrides: tuple[str, ...], match: str
) -> None:
    monkeypatch.setattr(run_tolerance, "ulfm_missing", lambda: None)
    rule, config = digits("elastic.enabled=true", *overrides)
    with pytest.raises(ConfigError, match=match):
        resolve_elastic(config, rule, WORLD)  # type: ignore[arg-type]
    rule, config = digits("elastic.enabled=auto", *overrides)
    assert resolve_elastic(config, rule, WORLD) is False  # type: ignore[arg-type]
    assert resolve_elastic(config, rule, replace(WORLD, rank=1)) is False  # type: ignore[arg-type]


def test_servers_that_forget_lost_workers_are_elastic(monkeypatch: pytest.MonkeyPatch) -> None:
    """ASGD, SSP, PSGD, WEEDOUT and GSP (a groups file or one group) with server ranks, EASGD (both modes),
    GOSGD; not GSP with groups by speed (auto)."""
    monkeypatch.setattr(run_tolerance, "ulfm_missing", lambda: None)
    for rule_args in (
        ("RULE=ASGD",),
        ("RULE=SSP",),
        ("RULE=PSGD",),
        ("RULE=WEEDOUT",),
        ("RULE=EASGD", "rule.mode=async"),
        ("RULE=EASGD",),
        ("RULE=GOSGD",),
        ("RULE=GSP",),
    ):
        rule, config = digits("elastic.enabled=true", *rule_args, "checkpoint.on_signal=false")
        assert resolve_elastic(config, rule, WORLD) is True  # type: ignore[arg-type]
    rule, config = digits(
        "elastic.enabled=true", "RULE=GSP", "rule.groups=auto", "checkpoint.on_signal=false"
    )
    with pytest.raises(ConfigError, match=r"RULE=GSP with \[rule\] groups = auto is not elastic"):
        resolve_elastic(config, rule, WORLD)  # type: ignore[arg-type]


def test_asynchronous_rules_with_coordinated_snapshots_are_elastic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots (the signal stop, periodic checkpoints) meet over the survivors
    (training/elastic/elastic_pause.py):
    the parameter-server rules, async EASGD, GOSGD, and GSP (its groups' pause agreement is a committed group
    step) stay elastic with them on."""
    monkeypatch.setattr(run_tolerance, "ulfm_missing", lambda: None)
    rules = (("RULE=ASGD",), ("RULE=SSP",), ("RULE=EASGD", "rule.mode=async"), ("RULE=GOSGD",), ("RULE=GSP",))
    for rule_args in rules:
        for snapshots in (("checkpoint.on_signal=true",), ("checkpoint.every_steps=20",)):
            rule, config = digits("elastic.enabled=true", *rule_args, *snapshots)
            assert resolve_elastic(config, rule, WORLD) is True, (rule_args, snapshots)  # type: ignore[arg-type]


def test_a_fault_tolerant_job_finalizes_without_the_fence_a_dead_rank_can_hold_up() -> None:
    """Under ``--with-ft ulfm`` (Open MPI sets ``OMPI_MCA_mpi_ft_enable``) MPI_Finalize's PMIx fence is left
    out (it hung 6 of 80 jobs after a SIGKILL here); a value the user set wins, and other jobs keep it."""
    ft = {FT_VARIABLE: "true"}
    assert skip_finalize_fence(ft) and ft[NO_FINALIZE_FENCE] == "1"
    mine = {FT_VARIABLE: "1", NO_FINALIZE_FENCE: "0"}
    assert skip_finalize_fence(mine) and mine[NO_FINALIZE_FENCE] == "0"
    plain: dict[str, str] = {}
    assert not skip_finalize_fence(plain) and plain == {}
    assert not skip_finalize_fence({FT_VARIABLE: "false"})


def test_an_elastic_rank_whose_finalize_hangs_ends_itself() -> None:
    """An elastic rank arms a deadline before it exits: a process that is still there ``seconds`` later
    (Open MPI's MPI_Finalize stuck disconnecting from a replacement's job) ends by SIGALRM, and one that
    exits in time is not touched."""
    script = (
        "import time, sys; from mpicrossbow.launch.finalize_fence import bound_finalize; bound_finalize(1); "
    )
    hung = run_local([sys.executable, "-c", script + "time.sleep(30)"], timeout=20)
    assert hung.returncode == -signal.SIGALRM
    quick = run_local([sys.executable, "-c", script + "sys.exit(3)"], timeout=20)
    assert quick.returncode == 3


def test_a_rule_refuses_to_rebind_unless_it_says_how() -> None:
    class Plain(Rule):
        name = "PLAIN"

    class Follows(Rule):
        name = "FOLLOWS"

        def on_rebind(self, lost: tuple[int, ...]) -> None:
            """Nothing to rebuild."""

    assert "RULE=PLAIN does not support elastic" in str(Plain().elastic_obstacle())
    assert Follows().elastic_obstacle() is None
    with pytest.raises(ConfigError, match="RULE=PLAIN does not support"):
        Plain().on_rebind((1,))


LEAVER = """
import sys
from pathlib import Path
from mpicrossbow.launch.failure import leave_job
from mpicrossbow.launch.world import World

world = World(rank=2, size=4, local_rank=2, local_size=4, node=0, nodes=1, hostname="h", launcher=None)
try:
    raise ValueError("a bug in step 7")
except ValueError as exc:
    leave_job(world, exc, Path(sys.argv[1]))
print("still here")
"""


def test_a_failing_elastic_rank_writes_its_traceback_and_dies_by_sigkill(tmp_path: Path) -> None:
    """ULFM reports a rank that ends by a signal, never one that exits: after its line and traceback file
    the rank SIGKILLs itself."""
    proc = run_local([sys.executable, "-c", LEAVER, str(tmp_path)], timeout=60)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    assert "still here" not in proc.stdout
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith(ERROR_PREFIX)]
    assert "rank 2 of 4 on h failed and leaves the job: ValueError: a bug in step 7" in line
    assert f"traceback in {tmp_path / 'rank2.traceback'}" in line
    assert "a bug in step 7" in (tmp_path / "rank2.traceback").read_text()
