"""LOCALSGD and DILOCO against their numpy references (tests/reference.py), fed the gradients taken.

As in test_rules_sync.py: each rank (a thread of the in-process world) trains MLP replicas on its own digits
shard, every learner's gradient at every step is recorded, and numpy replays the rule with those gradients
(torch's SGD momentum included). Equal weights after STEPS steps mean the framework computes exactly the
equations. Then the invariants that tie the rules together (each rule's real ``mpiexec -n 4`` digits job is
a run of tests/test_digits_rules_mpi.py; hyper-parameter errors are the rule contract's,
tests/test_rule_contract.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import reference
from conftest import LR, MOMENTUM, WorldRun, run_world
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import OptimSection
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP, DiLoCo, LocalSGD, Rule
from mpicrossbow.testing import InProcessWorld

STEPS = 9
SGD = reference.Sgd(LR, MOMENTUM)
CASES = [(1, 1), (2, 1), (4, 1), (1, 3), (2, 2), (4, 2)]


def run(
    size: int,
    make_rule: Callable[[], Rule],
    learners: int = 1,
    momentum: float = MOMENTUM,
    ranks_per_node: int | None = None,
) -> WorldRun:
    """STEPS steps of ``make_rule()`` on MLP replicas, ``learners`` per rank (``evals``: the mean model)."""
    optim = OptimSection(lr=LR, momentum=momentum)
    return run_world(size, make_rule, STEPS, optim=optim, learners=learners, ranks_per_node=ranks_per_node)


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal to float32 round-off of the framework against numpy's float64."""
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("size", "learners"), CASES)
def test_localsgd_equals_numpy(size: int, learners: int) -> None:
    """Mean of all k learners every 4 steps (steps 4 and 8 of 9: the final weights differ again)."""
    out = run(size, lambda: LocalSGD(period=4), learners=learners)
    w = reference.localsgd(out.w0, out.learner_grads(), SGD, period=4)
    final = out.learner_final()
    for got, want in zip(final, w, strict=True):
        assert_close(got, want)
    if size * learners > 1:
        assert not np.allclose(final[0], final[-1])  # step 9 is local: the learners have drifted apart
    for e in out.evals:  # sync_state's mean model, the same on every rank
        assert e is not None
        assert_close(e, sum(w) / len(w))


@pytest.mark.parametrize(("size", "learners", "ranks_per_node"), [(4, 1, 2), (4, 2, 2), (2, 2, 1), (4, 1, 4)])
def test_hierarchical_localsgd_equals_numpy(size: int, learners: int, ranks_per_node: int) -> None:
    """Every 2 steps the learners of one node, every 6 all k (step 6 is global, steps 2, 4, 8 node-local)."""
    out = run(
        size, lambda: LocalSGD(period=6, inner_period=2), learners=learners, ranks_per_node=ranks_per_node
    )
    node = lambda g: g // learners // ranks_per_node  # noqa: E731
    w = reference.localsgd(out.w0, out.learner_grads(), SGD, period=6, inner=2, group=node)
    final = out.learner_final()
    for got, want in zip(final, w, strict=True):
        assert_close(got, want)
    assert all(rule.node.size == ranks_per_node for rule in out.rules)
    if ranks_per_node < size:  # two nodes averaged apart since step 6
        assert not np.allclose(final[0], final[-1])


@pytest.mark.parametrize(("size", "learners"), CASES)
def test_diloco_equals_numpy(size: int, learners: int) -> None:
    out = run(size, lambda: DiLoCo(period=3), learners=learners)
    w, z, v = reference.diloco(out.w0, out.learner_grads(), SGD, period=3, outer_lr=0.7, outer_momentum=0.9)
    for got, want in zip(out.learner_final(), w, strict=True):
        assert_close(got, want)  # step 9 was an outer step: every learner is z
    for rule, e in zip(out.rules, out.evals, strict=True):
        assert_close(e, z)
        assert_close(rule.v.numpy(), v)


def test_localsgd_period_one_without_momentum_is_bsp_avg() -> None:
    local = run(2, lambda: LocalSGD(period=1), learners=2, momentum=0.0).learner_final()
    bsp = run(2, lambda: BSP(mode="avg"), learners=2, momentum=0.0).learner_final()
    for a, b in zip(local, bsp, strict=True):
        np.testing.assert_array_equal(a, b)


def test_diloco_with_unit_outer_lr_and_no_momentum_is_localsgd() -> None:
    diloco = run(2, lambda: DiLoCo(period=3, outer_lr=1.0, outer_momentum=0.0), learners=2).learner_final()
    local = run(2, lambda: LocalSGD(period=3), learners=2).learner_final()
    for a, b in zip(diloco, local, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_diloco_checkpoint_holds_the_outer_model_and_its_momentum() -> None:
    """DILOCO's state beyond LOCALSGD's is z, the model it validates, and v (the round trip through
    ``load_state_dict`` is the rule contract's, tests/test_rule_contract.py)."""
    out = run(1, lambda: DiLoCo(period=3))
    state = out.rules[0].state_dict()
    assert sorted(state) == ["hyper", "v", "z"]
    assert state["hyper"] == {"period": 3, "inner_period": 0, "outer_lr": 0.7, "outer_momentum": 0.9}
    assert state["v"].abs().sum() > 0
    np.testing.assert_array_equal(state["z"].numpy(), out.evals[0])


@pytest.mark.parametrize("diloco", [False, True], ids=["LOCALSGD", "DILOCO"])
def test_resize_averages_over_the_new_learner_count(diloco: bool) -> None:
    """After growing from 1 to 3 learners per rank, the average divides by k = 2 ranks × 3."""

    def body(comm: Communicator) -> tuple[np.ndarray, list[np.ndarray]]:
        torch.manual_seed(0)
        pool = SerialPool(
            MLP(hidden=8), PoolSpec(comm.rank, comm.size, 8, OptimSection(lr=0.1), torch.device("cpu"))
        )
        rule = (DiLoCo(period=2) if diloco else LocalSGD(period=2)).bind(comm, pool)
        z0 = pool.learners[0].params.numpy().copy()
        pool.resize(3)
        rule.on_resize()
        for j, learner in enumerate(pool.learners):
            learner.params.fill_(float(comm.rank * 3 + j))  # 0..5 over the world: mean 2.5
        rule.exchange(0)  # not a multiple of the period: nothing moves
        assert float(pool.learners[0].params[0]) == comm.rank * 3
        rule.exchange(1)
        return z0, [learner.params.numpy().copy() for learner in pool.learners]

    for z0, per_rank in InProcessWorld(2).run(body):
        # DiLoCo's first outer step: v = Δ = z0 − 2.5, z = z0 − 0.7 (Δ + 0.9 Δ)
        expected = z0 - 0.7 * 1.9 * (z0 - 2.5) if diloco else np.full_like(z0, 2.5)
        for params in per_rank:
            np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)


def test_after_each_periods_average_every_replica_is_bit_for_bit_equal() -> None:
    """What AUTO relies on to move away from LOCALSGD without an average of its own: at a step where
    ``averaged_before`` says the exchange before it averaged (every H-th), every learner of every rank holds
    the same weights, bit for bit."""
    rule = LocalSGD(period=4)
    assert [step for step in range(13) if rule.averaged_before(step)] == [4, 8, 12]
    out = run_world(
        2, lambda: LocalSGD(period=4), 8, optim=OptimSection(lr=LR, momentum=MOMENTUM), learners=2
    )
    final = out.learner_final()
    assert len(final) == 4 and all(np.array_equal(final[0], other) for other in final[1:])
