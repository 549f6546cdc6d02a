"""``[elastic] replace`` (issue 40 point 4): what is refused before training, and the protocol's local parts.
The replacements themselves are spawned in real Open MPI jobs (tests/test_elastic_mpi.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from conftest import REPO
from mpicrossbow.comm.membership import Membership
from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.rules.registry import resolve
from mpicrossbow.training.elastic import replacement
from mpicrossbow.training.elastic.replacement import (
    REPLACES,
    Handover,
    check_replace,
    replace_obstacle,
    replaced_rank,
    spawn_replacements,
)

DIGITS = str(REPO / "launch" / "digits.cfg")


def obstacle(elastic: bool, *overrides: str) -> str | None:
    """What ``replace = true`` meets for the digits job with ``overrides``."""
    rule, config = resolve(load_config(DIGITS, ["elastic.replace=true", *overrides]))
    return replace_obstacle(config, rule, elastic)


def test_synchronous_elastic_rules_take_replacements() -> None:
    """BSP, SMA, LOCALSGD, EASGD (sync) and POSTLOCALSGD: nothing stands in the way."""
    for rule in ("BSP", "SMA", "LOCALSGD", "EASGD", "POSTLOCALSGD"):
        assert obstacle(True, f"RULE={rule}") is None, rule


@pytest.mark.parametrize(
    ("elastic", "overrides", "said"),
    [
        (False, (), "needs elastic training"),
        (True, ("RULE=ASGD",), "RULE=ASGD is asynchronous"),
        (True, ("RULE=GOSGD",), "RULE=GOSGD is asynchronous"),
        (True, ("RULE=EASGD", "rule.mode=async"), "RULE=EASGD is asynchronous"),
        (True, ("pool.learners=auto",), "needs a fixed learner count"),
    ],
)
def test_what_a_replacement_cannot_join_is_one_line(
    elastic: bool, overrides: tuple[str, ...], said: str
) -> None:
    """Each refusal names the setting; the combinations check raises it as a ConfigError (exit 2)."""
    line = obstacle(elastic, *overrides)
    assert line is not None and said in line and "[elastic] replace = true" in line
    rule, config = resolve(load_config(DIGITS, ["elastic.replace=true", *overrides]))
    with pytest.raises(ConfigError, match="replace"):
        check_replace(config, rule, elastic)


def test_replace_is_off_by_default() -> None:
    """No replacement unless asked: the default job has nothing to refuse."""
    rule, config = resolve(load_config(DIGITS, []))
    assert config.elastic.replace is False and replace_obstacle(config, rule, False) is None


def test_a_replacement_is_known_by_its_environment() -> None:
    """Survivors name the start rank a replacement stands for in its environment; a start rank has none."""
    assert replaced_rank({REPLACES: "2"}) == 2
    assert replaced_rank({}) is None
    assert replaced_rank({REPLACES: ""}) is None


class _Learner:
    def __init__(self, value: float) -> None:
        self.params = torch.full((3,), value)


class _Pool:
    def __init__(self) -> None:
        self.learners = [_Learner(1.0), _Learner(2.0)]
        self.loaded: object = None

    def load_state_dict(self, state: object) -> None:
        self.loaded = state


class _Rule:
    def __init__(self) -> None:
        self.loaded: object = None

    def load_state_dict(self, state: object) -> None:
        self.loaded = state


def test_the_handover_loads_the_state_then_sets_every_learner_to_the_consensus() -> None:
    """A replacement's learners all start at the survivors' consensus, after the survivor's state (its
    optimizer's momenta, the rule's z) is loaded."""
    pool, rule = _Pool(), _Rule()
    consensus = torch.tensor([0.5, -1.0, 3.0])
    left = Handover(({"pool": 1}, {"rule": 2}, {"kept": 3}), consensus).install([pool, rule], pool.learners)
    assert pool.loaded == {"pool": 1} and rule.loaded == {"rule": 2}
    assert left == ({"kept": 3},)  # the embedded API's xb.keep objects, loaded as the script makes them
    assert all(torch.equal(learner.params, consensus) for learner in pool.learners)


class _Merged:
    def Set_errhandler(self, handler: object) -> None:
        self.handler = handler


class _Inter:
    def Merge(self, high: bool) -> _Merged:
        assert high is False  # the survivors come first
        return _Merged()


class _Survivors:
    """An mpi4py communicator's stand-in: records each spawn's hosts; fails the spawns ``refuse`` says."""

    def __init__(self, refuse: int) -> None:
        self.refuse = refuse
        self.tried: list[list[str | None]] = []

    def Get_rank(self) -> int:
        return 0

    def Spawn_multiple(
        self, commands: list[str], args: list[list[str]], n: list[int], infos: list[Any], root: int
    ) -> _Inter:
        from mpi4py import MPI

        self.tried.append([info.Get("host") for info in infos])
        # a directive of the whole spawn, given once: Open MPI 5 refuses it repeated on each process
        assert [info.Get("map_by") for info in infos] == ["slot:OVERSUBSCRIBE"] + [None] * (len(infos) - 1)
        if len(self.tried) <= self.refuse:
            raise MPI.Exception(MPI.ERR_SPAWN)
        return _Inter()


@pytest.mark.parametrize(("refuse", "tries", "started"), [(0, 1, True), (1, 2, True), (2, 2, False)])
def test_a_replacement_goes_to_the_lost_hosts_else_anywhere_else_nowhere(
    refuse: int, tries: int, started: bool
) -> None:
    """The spawn asks for each lost rank's host; when that fails (a lost node) it asks again without hosts;
    when that fails too there is no replacement (None: training goes on with the survivors)."""
    survivors = _Survivors(refuse)
    merged = spawn_replacements(survivors, (2, 5), ("node2", "node3"))
    assert (merged is not None) is started
    assert survivors.tried[:tries] == [["node2", "node3"], [None, None]][:tries]
    assert len(survivors.tried) == tries


class _Duplicate:
    def Get_size(self) -> int:
        return 3


class _Duplicable:
    """A survivors' communicator stand-in whose Dup() is what the background spawn runs over."""

    def __init__(self) -> None:
        self.duplicate = _Duplicate()

    def Dup(self) -> _Duplicate:
        return self.duplicate


def test_replacements_start_on_a_thread_while_the_survivors_train_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """BackgroundSpawn runs the spawn and the greeting over the communicator's duplicate on a thread of its
    own: it is not done while the spawn waits for the new process (the survivors' steps go on meanwhile),
    then gives the merged communicator and the replacements' hosts; an error in the thread is raised where
    the result is asked for; without MPI_THREAD_MULTIPLE it runs at once."""
    started, release = threading.Event(), threading.Event()
    calls: list[tuple[Any, ...]] = []

    def spawn(native: Any, ranks: tuple[int, ...], hosts: tuple[str, ...]) -> Any:
        calls.append((native, ranks, hosts))
        started.set()
        if not release.wait(10):
            raise RuntimeError("never released")
        return "merged"

    monkeypatch.setattr(replacement, "spawn_replacements", spawn)
    monkeypatch.setattr(replacement, "connect", lambda merged, first: ["node2"])
    survivors = _Duplicable()
    spawning = replacement.BackgroundSpawn(survivors, (2,), ("node2",))
    assert started.wait(10)
    steps = 0
    for _ in range(5):  # the survivors' steps while the new process starts
        assert not spawning.done
        steps += 1
    release.set()
    assert spawning.result() == ("merged", ["node2"]) and spawning.done and steps == 5
    assert calls == [(survivors.duplicate, (2,), ("node2",))]

    def failing(native: Any, ranks: tuple[int, ...], hosts: tuple[str, ...]) -> Any:
        raise ValueError("the spawn failed")

    monkeypatch.setattr(replacement, "spawn_replacements", failing)
    with pytest.raises(ValueError, match="the spawn failed"):
        replacement.BackgroundSpawn(_Duplicable(), (2,), ()).result()
    monkeypatch.setattr(replacement, "spawn_replacements", lambda native, ranks, hosts: None)
    at_once = replacement.BackgroundSpawn(_Duplicable(), (2,), (), threaded=False)
    assert at_once.done and at_once.result() == (None, []) and not at_once.threaded


def test_the_survivors_train_through_a_spawn_on_one_host_and_wait_for_one_across_hosts() -> None:
    """Open MPI's spawn on a thread stalled the survivors' collectives across hosts for minutes: there the
    spawn runs at once; on one host (or hosts unknown) on a thread, when MPI allows threads at all."""
    one_host = {0: "node1", 1: "node1", 2: "node1"}
    assert replacement.spawn_threaded(True, one_host) and replacement.spawn_threaded(True, {})
    assert not replacement.spawn_threaded(True, {**one_host, 3: "node2"})
    assert not replacement.spawn_threaded(False, one_host)


class _Owner:
    """What :class:`~mpicrossbow.training.elastic.replacement.Replacements` reads of its owner on one
    survivor (rank 0 of ``size``): the membership, a MAX allreduce whose other members hold ``peer_count``."""

    def __init__(self, size: int, peer_count: int = 0) -> None:
        self.followers: list[Any] = []
        self.pending, self.skip_until = 0, 0
        self.peer_count = peer_count
        self.comm = self
        self.exact = self
        self.group = self
        self.native = "survivors"
        self.membership = Membership(1, tuple(range(size)), 0)

    def allreduce_scalars(self, values: list[float], op: Any) -> list[float]:
        return [max(values[0], float(self.peer_count))]


def test_replacements_stop_at_max_replacements_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``[elastic] max_replacements``: the vacancies the limit allows are filled, in order, and counted
    with the highest count any survivor holds (a former replacement counts from 0); past the limit a lost
    rank stays vacant, said in one line on rank 0, and nothing is spawned. Default 3; at least 1."""
    spawned: list[tuple[int, ...]] = []

    class Started:
        def __init__(self, native: Any, ranks: tuple[int, ...], hosts: tuple[str, ...], _: bool) -> None:
            spawned.append(ranks)
            self.start_ranks, self.done = ranks, True

    monkeypatch.setattr(replacement, "BackgroundSpawn", Started)
    owner = _Owner(size=2)
    places = replacement.Replacements(owner, threaded=False, limit=2)  # type: ignore[arg-type]
    whole = Membership(0, (0, 1, 2, 3), 0, ("a", "b", "c", "d"))
    for follower in owner.followers:
        follower(whole, Membership(1, (0, 1), 0, ("a", "b")))  # start ranks 2 and 3 lost
    assert places.due(10) is None and spawned == [(2, 3)] and places.started == 2
    assert places.due(11) is not None and places.vacancies == ()  # admitted
    for follower in owner.followers:
        follower(whole, Membership(3, (0, 1, 3), 0, ("a", "b", "d")))  # start rank 2's replacement lost
    with caplog.at_level("WARNING"):
        assert places.due(20) is None
    assert spawned == [(2, 3)] and places.vacancies == ()
    said = [r.getMessage() for r in caplog.records if "not replaced" in r.getMessage()]
    assert said == [
        "elastic: start rank(s) 2 not replaced: the job started its 2 replacement(s) ([elastic] "
        "max_replacements = 2); training goes on with 2 rank(s)"
    ]
    fresh = replacement.Replacements(_Owner(size=3, peer_count=2), threaded=False, limit=3)  # type: ignore[arg-type]
    fresh.vacancies = (1, 2)  # one of the limit's three left, by a peer's count
    assert fresh.due(5) is None and spawned[-1] == (1,) and fresh.started == 3
    defaults = load_config(DIGITS, ["elastic.replace=true"]).elastic
    assert defaults.max_replacements == 3
    with pytest.raises(ConfigError, match="max_replacements"):
        load_config(DIGITS, ["elastic.replace=true", "elastic.max_replacements=0"])
