"""The Rule contract, bound to every registered rule (``RULES.names()``).

What the session relies on, whichever rule runs:

(a) ``Rule(**hyper)`` validates its hyper-parameters, derived here from each rule's ``Config`` dataclass: an
    unknown key, a value of the wrong type and a value just outside each declared bound are each one
    ConfigError line naming ``[rule] <key>``; the checks across keys and of the world size that some rules
    add are a small table of their own.
(b) ``bind`` makes every learner of every rank start from rank 0's learner 0, weights and BatchNorm
    buffers, bit for bit (each rank's pool is built under its own seed).
(c) After some steps (or the ``serve`` loop, on a rank the rule keeps out of training) and ``finish()``,
    nothing is in flight on any rank and the run ends (the in-process world's timeout bounds it).
(d) ``state_dict()`` loaded into a fresh bound rule gives back the same ``state_dict()``.
(e) A rule that says it heals from a peer (``heals_from_peer``: elastic training then copies nothing per
    step) keeps that promise: an exchange whose collective fails halfway through leaves its state and its
    learners' whole, and it trains on once rebound.

:data:`CASES` gives each rule small hyper-parameters and a world it runs in (2 learners per rank); a rule
registered without a case fails :func:`test_every_registered_rule_has_a_case`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytest
import torch

from conftest import OPTIM, NormedMLP, WorldRun, run_world, train_steps
from mpicrossbow.comm.base import Communicator, Handle, ReduceOp
from mpicrossbow.comm.forwarding import ForwardingCommunicator
from mpicrossbow.comm.ulfm import PeerLost
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.serial import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import RULES, Rule
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.run.step import train_step

STEPS, LEARNERS = 4, 2


@dataclass(frozen=True)
class Case:
    """A rule with hyper-parameters it runs with, in a world of ``size`` ranks."""

    name: str
    hyper: Mapping[str, Any]
    size: int

    @property
    def id(self) -> str:
        """``NAME`` or ``NAME-key=value,...``."""
        return "-".join([self.name, *(f"{k}={v}" for k, v in self.hyper.items())])

    def make(self, **extra: Any) -> Rule:
        """The rule built from the case's hyper-parameters, updated with ``extra``."""
        return RULES.get(self.name)(**{**self.hyper, **extra})


CASES = [
    Case("ASGD", {"servers": 2}, 3),
    Case("AUTO", {"measure_steps": 2, "candidates": "SMA"}, 2),
    Case("AUTO", {"measure_steps": 3}, 2),
    Case("BSP", {}, 2),
    Case("DILOCO", {"period": 2}, 2),
    Case("EASGD", {"tau": 2}, 2),
    Case("EASGD", {"mode": "async", "tau": 2}, 3),
    Case("GOSGD", {"p": 0.5}, 3),
    Case("GSP", {}, 3),
    Case("LOCALSGD", {"period": 2, "inner_period": 1}, 2),
    Case("POSTLOCALSGD", {"then": "SMA", "switch_epoch": 0.04}, 2),
    Case("PSGD", {"max_advance": 1}, 3),
    Case("SMA", {}, 2),
    Case("SSP", {"staleness": 1}, 3),
    Case("WEEDOUT", {}, 3),
]
EACH_CASE = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])


def test_every_registered_rule_has_a_case() -> None:
    assert sorted({case.name for case in CASES}) == RULES.names()


# --------------------------------------------------------------------------- (a) hyper-parameter validation
SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
UNKNOWN = "rate"  # no rule has this key


def _wrong_type(name: str, tp: Any) -> tuple[Any, str]:
    """A value of the wrong type for annotation ``tp`` and the message it must give."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        return "x", f"[rule] {name}: 'x' is not valid; choose one of {', '.join(map(str, args))}"
    base = args[0] if len(args) == 1 else tp  # ``float | None`` is validated as a float
    expected = {int: "an integer", float: "a number", bool: "true or false"}
    if base in expected:
        return "x", f"[rule] {name}: expected {expected[base]}, got 'x'"
    if base is str:
        return 1.5, f"[rule] {name}: expected a string, got 1.5"
    raise AssertionError(f"[rule] {name}: no wrong-type value for {tp!r}; extend _wrong_type")


def _outside(name: str, tp: Any, bound: str, limit: float) -> tuple[Any, str]:
    """A value just outside ``bound`` (ge, gt, le, lt) ``limit`` and the message it must give."""
    integer = int in (tp, *typing.get_args(tp))
    step = {"ge": -1, "le": 1}.get(bound, 0) * (1 if integer else 0.5)  # gt/lt: the limit itself
    value = limit + step if integer else float(limit + step)
    return value, f"[rule] {name}: {value} is out of range; must be {SIGNS[bound]} {limit}"


def validation_cases() -> list[Any]:
    """For every case: an unknown key, then per field a wrong type and each bound, as pytest params."""
    params = []
    for case in CASES:
        config = RULES.get(case.name).Config
        fields = [f for f in dataclasses.fields(config) if f.init]
        hints = typing.get_type_hints(config)
        valid = ", ".join(f.name for f in fields)
        unknown = f"[rule] unknown key '{UNKNOWN}'; valid keys: {valid}"
        params.append(pytest.param(case, {UNKNOWN: 1}, unknown, id=f"{case.id}-unknown"))
        for f in fields:
            value, message = _wrong_type(f.name, hints[f.name])
            params.append(pytest.param(case, {f.name: value}, message, id=f"{case.id}-{f.name}-type"))
            for bound in SIGNS:
                if bound in f.metadata:
                    value, message = _outside(f.name, hints[f.name], bound, f.metadata[bound])
                    params.append(
                        pytest.param(case, {f.name: value}, message, id=f"{case.id}-{f.name}-{bound}")
                    )
    return params


@pytest.mark.parametrize(("case", "bad", "message"), validation_cases())
def test_bad_hyper_parameters_are_one_line_naming_the_key(
    case: Case, bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        case.make(**bad)
    assert str(error.value) == message


#: Checks across keys, and of the world size, that a rule adds to its Config's own.
SPECIFIC = [
    (
        "LOCALSGD",
        {"period": 4, "inner_period": 4},
        "[rule] inner_period: 4 must be less than period (4), or 0 for no inner averaging",
    ),
    (
        "DILOCO",
        {"period": 2, "inner_period": 3},
        "[rule] inner_period: 3 must be less than period (2), or 0 for no inner averaging",
    ),
    (
        "GSP",
        {"groups": "auto", "shares": "shares.txt"},
        "[rule] shares needs a groups file: with groups = auto the groups are not known when the data is "
        "sharded",
    ),
]
TOO_SMALL = [
    (
        "SSP",
        {},
        1,
        "RULE=SSP needs at least 2 ranks ([rule] servers = 1 serve the model, at least one more rank "
        "trains); this job has 1",
    ),
    (
        "ASGD",
        {"servers": 2},
        2,
        "RULE=ASGD needs at least 3 ranks ([rule] servers = 2 serve the model, at least one more rank "
        "trains); this job has 2",
    ),
    (
        "EASGD",
        {"mode": "async"},
        1,
        "[rule] mode = async needs at least 2 ranks (rank 0 serves the centre, ranks 1..N-1 train); "
        "this job has 1",
    ),
]


@pytest.mark.parametrize(("name", "hyper", "message"), SPECIFIC, ids=[row[0] for row in SPECIFIC])
def test_rule_specific_checks_across_keys(name: str, hyper: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        RULES.get(name)(**hyper)
    assert str(error.value) == message


@pytest.mark.parametrize(("name", "hyper", "size", "message"), TOO_SMALL, ids=[row[0] for row in TOO_SMALL])
def test_a_world_too_small_is_refused_before_bind(
    name: str, hyper: dict[str, Any], size: int, message: str
) -> None:
    """``trains`` (the session's first question, before any pool is built) refuses the job."""
    with pytest.raises(ConfigError) as error:
        RULES.get(name)(**hyper).trains(0, size)
    assert str(error.value) == message


# ----------------------------------------------------------------------- (b)-(d) a rule's life on a world
def _state_equal(a: Any, b: Any, where: str = "state") -> None:
    """``a == b`` with tensors compared exactly, through nested dicts and lists."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            _state_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), (
            f"{where}: {a!r} != {b!r}"
        )


@dataclass
class AfterFinish:
    """A rank right after ``finish``: what is in flight, its state, and a fresh rule's state once loaded."""

    in_flight: int
    state: dict[str, Any]
    reloaded: dict[str, Any]
    fresh_in_flight: int


def _reload(case: Case) -> Any:
    """``run_world``'s ``after_finish``: bind a fresh rule, load the state, then end the fresh rule's run
    (serve or nothing, then finish) so it too leaves nothing behind."""

    def after_finish(comm: Communicator, pool: LearnerPool, rule: Rule) -> AfterFinish:
        in_flight, state = rule.in_flight, rule.state_dict()
        fresh = case.make()
        trains = fresh.trains(comm.rank, comm.size)
        fresh.bind(comm, pool)
        fresh.load_state_dict(state)
        reloaded = fresh.state_dict()
        if not trains:
            fresh.serve(lambda params, epoch: None)
        fresh.finish()
        return AfterFinish(in_flight, state, reloaded, fresh.in_flight)

    return after_finish


_RUNS: dict[str, WorldRun] = {}


def lived(case: Case) -> WorldRun:
    """The case's rule on its world: bind, STEPS steps or serve, finish, the state round trip (once)."""
    if case.id not in _RUNS:
        _RUNS[case.id] = run_world(
            case.size,
            case.make,
            STEPS,
            model=lambda: NormedMLP(hidden=8),
            learners=LEARNERS,
            after_finish=_reload(case),
            timeout_s=30,
        )
    return _RUNS[case.id]


@EACH_CASE
def test_bind_starts_every_learner_from_rank_zeros_first(case: Case) -> None:
    """Weights and BatchNorm buffers of every learner of every rank: rank 0's learner 0's as built."""
    out = lived(case)
    params, buffers = (built[0] for built in out.built[0])
    assert not np.array_equal(out.built[1][0][0], params)  # rank 1 was built with other weights
    assert not np.array_equal(out.built[1][1][0], buffers)  # and other statistics
    for rank, (bound_params, bound_buffers) in enumerate(out.bound):
        for j in range(LEARNERS):
            np.testing.assert_array_equal(bound_params[j], params, err_msg=f"rank {rank} learner {j}")
            np.testing.assert_array_equal(bound_buffers[j], buffers, err_msg=f"rank {rank} learner {j}")


@EACH_CASE
def test_finish_leaves_nothing_in_flight(case: Case) -> None:
    """Every rank trained (or served, where the rule says it does not train), finished and returned."""
    out = lived(case)
    trains = [case.make().trains(rank, case.size) for rank in range(case.size)]
    assert [len(grads) for grads in out.grads] == [STEPS if t else 0 for t in trains]
    assert [after.in_flight for after in out.extra] == [0] * case.size
    assert [after.fresh_in_flight for after in out.extra] == [0] * case.size


@EACH_CASE
def test_state_dict_survives_load_state_dict(case: Case) -> None:
    """On every rank (server, worker or peer) a fresh bound rule that loads the state gives it back."""
    for rank, after in enumerate(lived(case).extra):
        assert after.state["hyper"] == dataclasses.asdict(case.make().hyper)
        _state_equal(after.reloaded, after.state, f"rank {rank}")


# ------------------------------------------------------------------ (e) a failed exchange leaves state whole
#: The rules that heal from a peer after a lost rank instead of committing windows (elastic training).
HEALING = [case for case in CASES if case.name in ("BSP", "DILOCO", "LOCALSGD", "SMA")]


class Scribbler(ForwardingCommunicator):
    """The rule's communicator whose collectives, once armed, fail halfway through: the buffer is scribbled
    with NaN (what an in-place collective may leave where a rank died inside it), then PeerLost."""

    armed = False

    def _fail(self, tensor: torch.Tensor) -> None:
        tensor.fill_(math.nan)
        raise PeerLost("a collective failed halfway through (scribbled by the test)")

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """The inner allreduce, or the failure when armed."""
        if self.armed:
            self._fail(tensor)
        return self.inner.allreduce(tensor, op, async_op)

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """The inner allreduce_mean, or the failure when armed."""
        if self.armed:
            self._fail(tensor)
        self.inner.allreduce_mean(tensor, count)


def _finite(state: Any) -> bool:
    """Whether every floating-point tensor in ``state`` (nested dicts and lists) is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, Mapping):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return True


def test_the_rules_that_heal_from_a_peer_are_the_synchronous_averaging_ones() -> None:
    """BSP (grad mode, once bound), SMA, LOCALSGD and DILOCO say so; every other rule commits windows."""
    healing = [case for case in CASES if case in HEALING]
    assert [case.name for case in healing] == ["BSP", "DILOCO", "LOCALSGD", "SMA"]
    assert not any(
        case.make().heals_from_peer for case in CASES if case not in HEALING and case.name != "BSP"
    )


@pytest.mark.parametrize("case", HEALING, ids=[c.id for c in HEALING])
def test_a_failed_exchange_leaves_a_healing_rules_state_whole(case: Case) -> None:
    """Three steps, then step 3's first collective fails halfway on every rank (step 3 is a global average
    of LOCALSGD and DILOCO at period 2): the step raises PeerLost, every tensor of the pool's and the rule's
    state is still finite (nothing half-summed reached it), and once rebound (as elastic training rebinds
    it to the survivors) the rule trains two more steps."""

    def body(comm: Communicator) -> tuple[bool, bool, bool]:
        torch.manual_seed(comm.rank)
        spec = PoolSpec(comm.rank, comm.size, 8, OPTIM, torch.device("cpu"), seed=1, learners=LEARNERS)
        pool, scribbler = SerialPool(NormedMLP(hidden=8), spec), Scribbler(comm)
        rule = case.make().bind(scribbler, pool)
        train_steps(pool, rule, 3)
        scribbler.armed = True
        with pytest.raises(PeerLost):
            train_step(pool, rule, 3)
        scribbler.armed = False
        whole = _finite(pool.state_dict()) and _finite(rule.state_dict())
        rule.on_rebind(())
        for step in (4, 5):
            train_step(pool, rule, step)
        return rule.heals_from_peer, whole, _finite(pool.state_dict()) and _finite(rule.state_dict())

    assert InProcessWorld(case.size, timeout_s=30).run(body) == [(True, True, True)] * case.size
