"""LOCALSGD and DILOCO against plain-numpy replays of their equations, fed the gradients the framework took.

As in test_rules_sync.py: each rank (a thread of the in-process world) trains MLP replicas on its own digits
shard, every learner's gradient at every step is recorded, and numpy replays the rule with those gradients
(torch's SGD momentum included). Equal weights after STEPS steps mean the framework computes exactly the
equations. Then the invariants that tie the rules together, hyper-parameter errors, and one real
``mpiexec -n 4`` digits job per rule.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import train_steps
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.comm.inprocess import InProcessWorld
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP, DiLoCo, LocalSGD, Rule

STEPS = 9
LR, MOMENTUM = 0.05, 0.9
CASES = [(1, 1), (2, 1), (4, 1), (1, 3), (2, 2), (4, 2)]


def run(
    size: int,
    make_rule: Callable[[], Rule],
    learners: int = 1,
    momentum: float = MOMENTUM,
    ranks_per_node: int | None = None,
) -> tuple[np.ndarray, list[np.ndarray], list[list[np.ndarray]], list[Any], list[np.ndarray | None]]:
    """Train STEPS steps; return the initial weights, the final weights and gradients per global learner
    (learner j of rank r is r·m + j), every rank's rule, and each rank's ``eval_params`` after ``sync_state``.
    """
    optim = OptimSection(lr=LR, momentum=momentum)
    pools = []
    for r in range(size):
        torch.manual_seed(r)
        pools.append(
            SerialPool(
                MLP(hidden=16), PoolSpec(r, size, 8, optim, torch.device("cpu"), seed=1, learners=learners)
            )
        )
    grads: list[list[np.ndarray]] = [[] for _ in range(size * learners)]
    rules: list[Any] = [None] * size
    start: list[np.ndarray] = [np.empty(0)] * size
    evals: list[np.ndarray | None] = [None] * size

    def body(comm: Communicator) -> list[np.ndarray]:
        pool = pools[comm.rank]
        rule = rules[comm.rank] = make_rule().bind(comm, pool)
        start[comm.rank] = pool.learners[0].params.numpy().copy()
        recorded = train_steps(pool, rule, STEPS)
        for j in range(learners):
            grads[comm.rank * learners + j] = [step[j] for step in recorded]
        rule.finish()
        final = [learner.params.numpy().copy() for learner in pool.learners]
        rule.sync_state()
        params = rule.eval_params()
        evals[comm.rank] = None if params is None else params.numpy().copy()
        return final

    world = InProcessWorld(size, ranks_per_node=ranks_per_node)
    final = [w for per_rank in world.run(body) for w in per_rank]
    assert all(np.array_equal(s, start[0]) for s in start)
    return start[0], final, grads, rules, evals


def local_steps(w: list[np.ndarray], buf: list[np.ndarray], grads: list, t: int, momentum: float) -> None:
    """torch SGD without Nesterov: buf ← μ buf + g; w ← w − η buf (in place on the lists)."""
    for j in range(len(w)):
        buf[j] = momentum * buf[j] + grads[j][t]
        w[j] = w[j] - LR * buf[j]


def numpy_localsgd(
    w0: np.ndarray, grads: list, period: int, inner: int, group: Callable[[int], int], momentum: float
) -> list[np.ndarray]:
    """Local steps; all k learners averaged every ``period``, learners of one group every ``inner``."""
    k = len(grads)
    w = [w0.astype(np.float64).copy() for _ in range(k)]
    buf = [np.zeros_like(w[0]) for _ in range(k)]
    for t in range(STEPS):
        local_steps(w, buf, grads, t, momentum)
        if (t + 1) % period == 0:
            w = [sum(w) / k] * k
        elif inner and (t + 1) % inner == 0:
            for g in {group(j) for j in range(k)}:
                members = [j for j in range(k) if group(j) == g]
                mean = sum(w[j] for j in members) / len(members)
                for j in members:
                    w[j] = mean
    return w


def numpy_diloco(
    w0: np.ndarray, grads: list, period: int, lr: float, mu: float
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """H inner steps, then Δ = z − mean(w), v ← μ v + Δ, z ← z − η (Δ + μ v), every learner ← z."""
    k = len(grads)
    w = [w0.astype(np.float64).copy() for _ in range(k)]
    buf = [np.zeros_like(w[0]) for _ in range(k)]
    z, v = w[0].copy(), np.zeros_like(w[0])
    for t in range(STEPS):
        local_steps(w, buf, grads, t, MOMENTUM)
        if (t + 1) % period == 0:
            delta = z - sum(w) / k
            v = mu * v + delta
            z = z - lr * (delta + mu * v)
            w = [z.copy() for _ in range(k)]
    return w, z, v


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("size", "learners"), CASES)
def test_localsgd_equals_numpy(size: int, learners: int) -> None:
    """Mean of all k learners every 4 steps (steps 4 and 8 of 9: the final weights differ again)."""
    w0, final, grads, _, evals = run(size, lambda: LocalSGD(period=4), learners=learners)
    w = numpy_localsgd(w0, grads, period=4, inner=0, group=lambda j: 0, momentum=MOMENTUM)
    for g in range(size * learners):
        assert_close(final[g], w[g])
    if size * learners > 1:
        assert not np.allclose(final[0], final[-1])  # step 9 is local: the learners have drifted apart
    for e in evals:  # sync_state's mean model, the same on every rank
        assert e is not None
        assert_close(e, sum(w) / len(w))


@pytest.mark.parametrize(("size", "learners", "ranks_per_node"), [(4, 1, 2), (4, 2, 2), (2, 2, 1), (4, 1, 4)])
def test_hierarchical_localsgd_equals_numpy(size: int, learners: int, ranks_per_node: int) -> None:
    """Every 2 steps the learners of one node, every 6 all k (step 6 is global, steps 2, 4, 8 node-local)."""
    w0, final, grads, rules, _ = run(
        size, lambda: LocalSGD(period=6, inner_period=2), learners=learners, ranks_per_node=ranks_per_node
    )
    w = numpy_localsgd(w0, grads, 6, 2, group=lambda j: j // learners // ranks_per_node, momentum=MOMENTUM)
    for g in range(size * learners):
        assert_close(final[g], w[g])
    assert all(rule.node.size == ranks_per_node for rule in rules)
    if ranks_per_node < size:  # two nodes averaged apart since step 6
        assert not np.allclose(final[0], final[-1])


@pytest.mark.parametrize(("size", "learners"), CASES)
def test_diloco_equals_numpy(size: int, learners: int) -> None:
    w0, final, grads, rules, evals = run(size, lambda: DiLoCo(period=3), learners=learners)
    w, z, v = numpy_diloco(w0, grads, period=3, lr=0.7, mu=0.9)
    for g in range(size * learners):
        assert_close(final[g], w[g])  # step 9 was an outer step: every learner is z
    for rule, e in zip(rules, evals, strict=True):
        assert_close(e, z)
        assert_close(rule.v.numpy(), v)


def test_localsgd_period_one_without_momentum_is_bsp_avg() -> None:
    _, local, *_ = run(2, lambda: LocalSGD(period=1), learners=2, momentum=0.0)
    _, bsp, *_ = run(2, lambda: BSP(mode="avg"), learners=2, momentum=0.0)
    for a, b in zip(local, bsp, strict=True):
        np.testing.assert_array_equal(a, b)


def test_diloco_with_unit_outer_lr_and_no_momentum_is_localsgd() -> None:
    _, diloco, *_ = run(2, lambda: DiLoCo(period=3, outer_lr=1.0, outer_momentum=0.0), learners=2)
    _, local, *_ = run(2, lambda: LocalSGD(period=3), learners=2)
    for a, b in zip(diloco, local, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_diloco_checkpoint_round_trip() -> None:
    *_, rules, _ = run(1, lambda: DiLoCo(period=3))
    state = rules[0].state_dict()
    assert state["hyper"] == {"period": 3, "inner_period": 0, "outer_lr": 0.7, "outer_momentum": 0.9}
    assert state["v"].abs().sum() > 0
    torch.manual_seed(0)
    pool = SerialPool(MLP(hidden=16), PoolSpec(0, 1, 8, OptimSection(lr=LR), torch.device("cpu"), seed=1))
    fresh = InProcessWorld(1).run(lambda comm: DiLoCo(period=3).bind(comm, pool))[0]
    fresh.load_state_dict(state)
    assert torch.equal(fresh.z, state["z"]) and torch.equal(fresh.v, state["v"])
    assert torch.equal(fresh.eval_params(), rules[0].z)


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


@pytest.mark.parametrize(
    ("cls", "hyper", "message"),
    [
        (LocalSGD, {"period": 0}, r"\[rule\] period: 0 is out of range; must be >= 1"),
        (LocalSGD, {"inner_period": -1}, r"\[rule\] inner_period: -1 is out of range; must be >= 0"),
        (LocalSGD, {"period": 4, "inner_period": 4}, r"\[rule\] inner_period: 4 must be less than period"),
        (LocalSGD, {"period": "x"}, r"\[rule\] period: expected an integer, got 'x'"),
        (DiLoCo, {"outer_lr": 0}, r"\[rule\] outer_lr: 0.0 is out of range; must be > 0"),
        (DiLoCo, {"outer_momentum": 1.0}, r"\[rule\] outer_momentum: 1.0 is out of range; must be < 1"),
        (DiLoCo, {"period": 0}, r"\[rule\] period: 0 is out of range; must be >= 1"),
        (DiLoCo, {"outer_lr": "fast"}, r"\[rule\] outer_lr: expected a number, got 'fast'"),
    ],
)
def test_hyper_parameters_are_validated(cls: type, hyper: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cls(**hyper)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "overrides",
    [("RULE=LOCALSGD", "rule.inner_period=2", "pool.learners=2"), ("RULE=DILOCO",)],
    ids=["LOCALSGD-hier-m2", "DILOCO"],
)
def test_digits_job_on_four_ranks(mpiexec: str, tmp_path: Path, overrides: tuple[str, ...]) -> None:
    """The bundled digits job under ``mpiexec -n 4`` learns, and nothing is left in flight.

    LOCALSGD runs hierarchical with 2 learners per rank, so the MPI shared-memory split is exercised too (on
    one machine the node is all 4 ranks).
    """
    from conftest import launcher, only_run, run_mpi
    from mpicrossbow.training.metrics import read_metrics

    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={tmp_path}", *overrides]
    proc = run_mpi(mpiexec, 4, args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path) / "metrics.h5")
    assert metrics["val"]["accuracy"][-1] >= 0.93, metrics["val"]["accuracy"]
    assert list(metrics["attrs"]["rank_in_flight"]) == [0, 0, 0, 0]
