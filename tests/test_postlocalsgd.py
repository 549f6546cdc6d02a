"""POSTLOCALSGD on in-process ranks: BSP until the switch, then the later rule, every rank at the same step.

What a user relies on: the switch comes at ``switch_epoch`` (or after the first learning-rate drop) on every
rank at once, from replicas that BSP kept identical; afterwards the run moves exactly as BSP for those steps
followed by the later rule on its own would; session.cfg records every key, the later rule's included; bad
settings are one ConfigError line, before any rank trains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from conftest import OPTIM, NormedMLP, stacked
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.launch.failure import agree
from mpicrossbow.launch.world import World
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP, RULES, PostLocalSGD, Rule
from mpicrossbow.rules.registry import resolve
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.run.session import Session
from mpicrossbow.training.run.step import train_step

SIZE, LEARNERS, STEPS = 2, 2, 8
#: Epochs of BSP: a tenth of an epoch of the digits shard (4 of its 44 steps per epoch on 2 ranks).
SWITCH_EPOCH = 0.1
LATER = {"SMA": {}, "LOCALSGD": {"period": 2}, "EASGD": {"tau": 2}}


def on_world(body: Callable[[Communicator, LearnerPool], Any]) -> list[Any]:
    """``body(comm, pool)`` on every rank of an in-process world; pools built as the session builds them
    (rank r under seed r: replicas differ until the rule binds)."""
    pools = []
    for rank in range(SIZE):
        torch.manual_seed(rank)
        spec = PoolSpec(rank, SIZE, 8, OPTIM, torch.device("cpu"), seed=1, learners=LEARNERS)
        pools.append(SerialPool(NormedMLP(hidden=8), spec))
    return InProcessWorld(SIZE, timeout_s=30).run(lambda comm: body(comm, pools[comm.rank]))


def trained(rule: Rule, comm: Communicator, pool: LearnerPool, steps: range) -> list[tuple[Any, ...]]:
    """``rule`` bound (at the first step) and run for ``steps``; per step: weights, buffers, switch step."""
    if steps.start == 0:
        rule.bind(comm, pool)
        pool.start_epoch(0)
    seen = []
    for step in steps:
        train_step(pool, rule, step)
        seen.append((stacked(pool), stacked(pool, "buffers"), getattr(rule, "switched_at", None)))
    rule.finish()
    return seen


def switch_step() -> tuple[int, int]:
    """The first step of the later rule, ``round(SWITCH_EPOCH × steps per epoch)``, and steps per epoch."""
    torch.manual_seed(0)
    spec = PoolSpec(0, SIZE, 8, OPTIM, torch.device("cpu"), seed=1, learners=LEARNERS)
    per_epoch = SerialPool(NormedMLP(hidden=8), spec).n_batch_train
    return round(SWITCH_EPOCH * per_epoch), per_epoch


def all_equal(rows: np.ndarray) -> bool:
    """Whether every row (learner) of every rank's array is the same, bit for bit."""
    first = rows[0][0]
    return all(np.array_equal(row, first) for per_rank in rows for row in per_rank)


@pytest.mark.parametrize("then", list(LATER))
def test_every_rank_switches_at_the_epoch_and_then_moves_as_the_later_rule(
    then: str, caplog: pytest.LogCaptureFixture
) -> None:
    at, per_epoch = switch_step()
    assert 0 < at < STEPS - 2
    hyper = {f"then_{k}": v for k, v in LATER[then].items()}
    rules: list[PostLocalSGD] = []

    def post_local(comm: Communicator, pool: LearnerPool) -> list[tuple[Any, ...]]:
        rule = PostLocalSGD(then=then, switch_epoch=SWITCH_EPOCH, **hyper)
        rules.append(rule)
        return trained(rule, comm, pool, range(STEPS))

    def by_hand(comm: Communicator, pool: LearnerPool) -> np.ndarray:
        """BSP for the first steps, then the later rule bound and run on its own."""
        trained(BSP(), comm, pool, range(at))
        later = RULES.get(then)(**LATER[then]).bind(comm, pool)
        trained(later, comm, pool, range(at, STEPS))
        return stacked(pool)

    with caplog.at_level(logging.INFO, logger="mpicrossbow.rules.postlocalsgd"):
        seen = on_world(post_local)
    assert [rule.switched_at for rule in rules] == [at] * SIZE
    assert all(rule.active is rule.later for rule in rules)
    switched = [r.getMessage() for r in caplog.records if "switched from BSP" in r.getMessage()]
    assert switched == [
        f"POSTLOCALSGD: switched from BSP to {then} at step {at} (epoch {at / per_epoch:.4g})"
    ]
    for step in range(STEPS):
        params = [per_rank[step][0] for per_rank in seen]
        assert [per_rank[step][2] for per_rank in seen] == [None if step < at - 1 else at] * SIZE
        if step < at:  # BSP: every replica the same after every step (the switch follows step at − 1)
            assert all_equal(params), f"step {step}"
    # at the switch BatchNorm statistics became the mean, the same in every learner of every rank
    assert all_equal([per_rank[at - 1][1] for per_rank in seen])
    assert not all(all_equal([per_rank[step][0] for per_rank in seen]) for step in range(at, STEPS))
    for mine, theirs in zip((per_rank[-1][0] for per_rank in seen), on_world(by_hand), strict=True):
        np.testing.assert_array_equal(mine, theirs)  # exactly the later rule's steps after the switch


def test_switch_lr_drop_comes_after_the_first_step_at_a_lower_rate() -> None:
    """A rise (warm-up) does not switch; the first drop makes that step BSP's last, on every rank."""
    rates = {1: 0.05, 3: 0.005}  # the step before which the rate changes (from 0.01) → the new rate

    def body(comm: Communicator, pool: LearnerPool) -> tuple[int | None, bool]:
        rule = PostLocalSGD(then="SMA", switch="lr_drop").bind(comm, pool)
        pool.start_epoch(0)
        lr = 0.01
        pool.set_lr(lr, 0)
        for step in range(STEPS):
            if step in rates:
                rule.on_lr_change(lr, rates[step])
                lr = rates[step]
                pool.set_lr(lr, 0)
            train_step(pool, rule, step)
        rule.finish()
        return rule.switched_at, hasattr(rule.later, "z")

    assert on_world(body) == [(4, True)] * SIZE


def test_a_drop_that_never_comes_leaves_bsp_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    def body(comm: Communicator, pool: LearnerPool) -> int | None:
        rule = PostLocalSGD(switch="lr_drop")
        rule.check_run(1.0)  # lr_drop: any run length is accepted
        trained(rule, comm, pool, range(3))
        return rule.switched_at

    with caplog.at_level(logging.WARNING, logger="mpicrossbow.rules.postlocalsgd"):
        assert on_world(body) == [None] * SIZE
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["POSTLOCALSGD: the learning rate never stepped down, so the whole run was BSP"]


def test_session_cfg_records_the_later_rules_keys_and_rebuilds_the_same_rule() -> None:
    overrides = ["DEVICES=cpu0", "RULE=POSTLOCALSGD", "rule.then=sma", "rule.then_alpha=0.25"]
    rule, config = resolve(load_config("launch/digits.cfg", overrides))
    assert dict(config.rule_params) == {
        "then": "SMA",
        "switch": "epoch",
        "switch_epoch": 1.0,
        "bsp_mode": "auto",
        "bsp_bucket_mb": 5.0,
        "then_alpha": 0.25,
        "then_momentum": 0.9,
    }
    again, recorded = resolve(load_config(text=config.to_ini()))
    assert recorded.rule_params == config.rule_params and again.later.hyper == rule.later.hyper
    assert rule.needs_gradients is False and PostLocalSGD(bsp_mode="grad").needs_gradients is True


ASYNC = "is asynchronous, and post-local SGD switches every rank at the same step from BSP to a synchronous "
ASYNC += "rule: SMA, LOCALSGD, EASGD (EASGD with then_mode = sync)"
BAD = [
    ({"then": "NOPE"}, "[rule] then = NOPE: post-local SGD switches to one of SMA, LOCALSGD, EASGD"),
    ({"then": "BSP"}, "[rule] then = BSP: post-local SGD switches to one of SMA, LOCALSGD, EASGD"),
    ({"then": "asgd"}, f"[rule] then = ASGD: ASGD {ASYNC}"),
    ({"then": "GOSGD"}, f"[rule] then = GOSGD: GOSGD {ASYNC}"),
    ({"then": "EASGD", "then_mode": "async"}, f"[rule] then_mode = async: EASGD {ASYNC}"),
    (
        {"then": "LOCALSGD", "then_alpha": 0.1},
        "[rule] unknown key 'then_alpha' for LOCALSGD; valid keys: then_period, then_inner_period",
    ),
    ({"then": "SMA", "then_alpha": 2}, "[rule] then_alpha: 2.0 is out of range; must be <= 1"),
    (
        {"bsp_mode": "grad-ish"},
        "[rule] bsp_mode: 'grad-ish' is not valid; choose one of auto, grad, avg, swap",
    ),
    (
        {"bsp_mode": "swap"},
        "[rule] bsp_mode = swap leaves the replicas apart, and post-local SGD starts from mini-batch SGD: "
        "use bsp_mode = grad, avg or auto",
    ),
]


@pytest.mark.parametrize(("hyper", "message"), BAD, ids=[str(hyper) for hyper, _ in BAD])
def test_bad_settings_are_one_config_error(hyper: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        PostLocalSGD(**hyper)
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rule.then=PSGD"], f"[rule] then = PSGD: PSGD {ASYNC}"),
        (
            ["rule.switch_epoch=3"],
            "[rule] switch_epoch = 3 is not before the end of the run (3 epoch(s)): it would be BSP "
            "throughout; lower switch_epoch or train longer",
        ),
        (
            ["rule.switch_epoch=1", "session.steps=30"],
            "[rule] switch_epoch = 1 is not before the end of the run",
        ),
    ],
    ids=["asynchronous-then", "switch-after-the-last-epoch", "switch-after-the-step-budget"],
)
def test_a_bad_setting_stops_the_job_with_one_line_before_training(
    overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the session's own set-up: exit status 2 and one error line, no training."""
    world = World(rank=0, size=1, local_rank=0, local_size=1, node=0, nodes=1, hostname="h", launcher=None)
    base = ["DEVICES=cpu0", "RULE=POSTLOCALSGD", "session.epochs=3"]
    cfg = load_config("launch/digits.cfg", [*base, *overrides])
    assert agree(world, Session(cfg, world).prepare_local) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and message in errors[0], errors


def test_the_later_rules_checks_of_the_learner_count_come_before_training_and_name_its_keys() -> None:
    """SMA refuses an α past its stability bound for k learners: before any BSP step, not at the switch."""
    rule = PostLocalSGD(then="SMA", then_alpha=0.9)
    rule.check_learners(2)
    with pytest.raises(ConfigError, match=r"^\[rule\] then_alpha = 0\.9 is past SMA's stability bound"):
        rule.check_learners(8)
