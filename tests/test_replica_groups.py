"""``[link]`` read and checked before any rank talks (:mod:`mpicrossbow.training.replica_groups`): the group
and the rendezvous from the cfg or the environment, one line for each thing missing or wrong, the rules that
cannot cross groups refused by name, and the data shards of every group's ranks laid end to end."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.launch.world import World
from mpicrossbow.rules.registry import resolve
from mpicrossbow.training.replica_groups import (
    LOST_FILE_ENV,
    check_linked,
    record_lost,
    resolve_link,
    shard_world,
)

CFG = "launch/digits.cfg"


def test_group_and_address_come_from_the_cfg_or_the_environment() -> None:
    config = load_config(CFG, ["link.groups=3"])
    env = {"CROSSBOW_GROUP": "2", "CROSSBOW_LINK_ADDRESS": "node1:29500"}
    resolved = resolve_link(config, env)
    assert (resolved.link.group, resolved.link.address) == (2, "node1:29500")
    given = load_config(CFG, ["link.groups=3", "link.group=1", "link.address=10.0.0.1:7"])
    assert (resolve_link(given, env).link.group, resolve_link(given, env).link.address) == (1, "10.0.0.1:7")
    alone = load_config(CFG)
    assert resolve_link(alone, {}) is alone  # groups = 1: nothing read


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (["link.groups=3"], {"CROSSBOW_LINK_ADDRESS": "h:1"}, r"needs this job's group: set \[link\] group"),
        (["link.groups=3"], {"CROSSBOW_GROUP": "x", "CROSSBOW_LINK_ADDRESS": "h:1"}, r"\(0\.\.2\), not 'x'"),
        (["link.groups=3", "link.group=3", "link.address=h:1"], {}, r"group = 3, but groups = 3 \(0\.\.2\)"),
        (["link.groups=3", "link.group=0"], {}, r"needs the rendezvous as host:port"),
        (["link.groups=3", "link.group=0", "link.address=node1"], {}, r"host:port .*, not 'node1'"),
    ],
)
def test_a_bad_group_or_address_is_one_line(overrides: list[str], env: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_link(load_config(CFG, overrides), env)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["RULE=GOSGD"], r"RULE=GOSGD cannot run across replica groups .* BSP, SMA, LOCALSGD, DILOCO"),
        (["RULE=ASGD"], r"RULE=ASGD cannot run across replica groups"),
        (["elastic.enabled=true"], r"a group is what is lost and survived"),
        (["pool.learners=auto"], r"needs a number of learners"),
        (["checkpoint.resume=latest"], r"resume one group's run folder with \[link\] groups = 1"),
    ],
)
def test_what_cannot_go_with_replica_groups_is_refused_by_name(overrides: list[str], message: str) -> None:
    config = load_config(CFG, ["link.groups=2", "link.group=0", "link.address=h:1", *overrides])
    rule, config = resolve(config, None)
    with pytest.raises(ConfigError, match=message):
        check_linked(config, rule)


def test_every_rule_that_only_allreduces_is_accepted() -> None:
    for name in ("BSP", "SMA", "LOCALSGD", "DILOCO"):
        rule, config = resolve(load_config(CFG, ["link.groups=2", f"RULE={name}"]), None)
        check_linked(config, rule)


def test_the_groups_shards_lie_end_to_end() -> None:
    """Group g's rank r reads shard g × size + r of groups × size; one group keeps its world."""
    world = World(rank=1, size=2, local_rank=1, local_size=2, node=0, nodes=1, hostname="h", launcher=None)
    config = load_config(CFG, ["link.groups=3", "link.group=2", "link.address=h:1"])
    assert dataclasses.astuple(shard_world(world, config))[:2] == (5, 6)
    assert shard_world(world, load_config(CFG)) is world


def test_lost_groups_are_appended_to_the_file_the_template_watches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``$CROSSBOW_LOST_GROUPS_FILE``: one ``<group> <host>`` line per lost group, appended loss after loss
    (groups.sbatch reads the new lines); nothing without the variable; a file that cannot be written costs a
    warning, never the run."""
    path = tmp_path / "lost-groups"
    monkeypatch.delenv(LOST_FILE_ENV, raising=False)
    record_lost({2: "node3"})
    assert not path.exists()
    monkeypatch.setenv(LOST_FILE_ENV, str(path))
    record_lost({2: "node3"})
    record_lost({1: "node2", 3: "node4"})
    assert path.read_text() == "2 node3\n1 node2\n3 node4\n"
    monkeypatch.setenv(LOST_FILE_ENV, str(tmp_path / "gone" / "lost-groups"))
    record_lost({2: "node3"})
    assert "could not record the lost group(s)" in caplog.text


def test_a_group_back_with_another_rank_count_is_one_line() -> None:
    """A group's job started again with fewer ranks than the others: its data shards would overlap theirs,
    so taking the peer's state stops it with one ConfigError naming both counts (before anything loads)."""
    import io
    from types import SimpleNamespace

    import torch

    from mpicrossbow.comm.linked import LinkedCommunicator
    from mpicrossbow.training.returning_group import take_group_state

    buffer = io.BytesIO()
    torch.save({"pool": {}, "rule": {}, "consensus": torch.zeros(1), "position": {}, "group_size": 2}, buffer)
    comm = LinkedCommunicator.__new__(LinkedCommunicator)  # a joining group's leader, its link stood in for
    comm.group, comm.joining = 2, True
    comm.take_state = lambda: buffer.getvalue()  # type: ignore[method-assign]
    world = SimpleNamespace(size=1, rank=0, bcast=lambda data: data)
    with pytest.raises(ConfigError) as refused:
        take_group_state(comm, world, None, None, None)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "[link] groups: group 2 came back with 1 rank(s), the others have 2; start each group's job with as "
        "many"
    )
