"""SMA and synchronous EASGD against plain-numpy implementations of docs/rules.md, fed the same gradients.

Each rank (a thread of the in-process world, sizes 1, 2 and 4) trains an MLP replica on its own digits shard;
the gradient every learner computed at every step is recorded, and numpy replays the rule's equations with
those gradients. If the framework's weights and centre equal numpy's after k steps, the framework computes
exactly the equations (the gradients were taken at the framework's own weights, which numpy reproduces).
"""

from __future__ import annotations

import sys
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
from mpicrossbow.rules import EASGD, SMA, Rule

STEPS = 9
LR, MOMENTUM = 0.05, 0.9


def run(
    size: int, make_rule: Any, nesterov: bool = False, learners: int = 1
) -> tuple[np.ndarray, list[np.ndarray], list, list]:
    """Train STEPS steps; return the initial weights, final weights and grads per global learner
    (rank-major: learner j of rank r is r·m + j), and every rank's rule."""
    optim = OptimSection(lr=LR, momentum=MOMENTUM, nesterov=nesterov)
    pools = []
    for r in range(size):
        torch.manual_seed(r)
        pools.append(
            SerialPool(
                MLP(hidden=16), PoolSpec(r, size, 8, optim, torch.device("cpu"), seed=1, learners=learners)
            )
        )
    grads: list[list[np.ndarray]] = [[] for _ in range(size * learners)]
    rules: list[Rule] = [None] * size  # type: ignore[list-item]
    start: list[np.ndarray] = [None] * size  # type: ignore[list-item]

    def body(comm: Communicator) -> np.ndarray:
        pool = pools[comm.rank]
        rule = rules[comm.rank] = make_rule().bind(comm, pool)
        start[comm.rank] = pool.learners[0].params.numpy().copy()
        recorded = train_steps(pool, rule, STEPS)
        for j in range(learners):
            grads[comm.rank * learners + j] = [step[j] for step in recorded]
        rule.finish()
        return [learner.params.numpy().copy() for learner in pool.learners]

    final = [w for per_rank in InProcessWorld(size).run(body) for w in per_rank]
    assert all(np.array_equal(s, start[0]) for s in start)  # bind broadcast rank 0's replica
    return start[0], final, grads, rules


def numpy_sma(w0: np.ndarray, grads: list, alpha: float, mu: float) -> tuple[list[np.ndarray], np.ndarray]:
    k = len(grads)
    w = [w0.astype(np.float64).copy() for _ in range(k)]
    v = [np.zeros_like(w[0]) for _ in range(k)]
    z, z_prev = w[0].copy(), w[0].copy()
    for t in range(STEPS):
        c = [alpha * (w[j] - z) for j in range(k)]
        for j in range(k):
            v[j] = MOMENTUM * v[j] - LR * grads[j][t]
            w[j] = w[j] + v[j] - c[j]
        z, z_prev = z + sum(c) + mu * (z - z_prev), z
    return w, z


@pytest.mark.parametrize(("size", "learners"), [(1, 1), (2, 1), (4, 1), (1, 4), (2, 3)])
def test_sma_equals_numpy(size: int, learners: int) -> None:
    """Corrections summed in the rank, one allreduce: the same z as numpy's sum over all k learners."""
    w0, final, grads, rules = run(size, lambda: SMA(momentum=0.5), learners=learners)
    k = size * learners
    w, z = numpy_sma(w0, grads, alpha=1.0 / k, mu=0.5)
    for g in range(k):
        np.testing.assert_allclose(final[g], w[g], rtol=1e-4, atol=1e-6)
    for rule in rules:
        np.testing.assert_allclose(rule.eval_params().numpy(), z, rtol=1e-4, atol=1e-6)


def test_sma_with_zero_alpha_and_momentum_leaves_z_unchanged() -> None:
    w0, final, _, rules = run(2, lambda: SMA(alpha=0.0, momentum=0.0))
    for rule in rules:
        np.testing.assert_array_equal(rule.eval_params().numpy(), w0)
    assert not np.array_equal(final[0], w0)  # the learners did move


def numpy_easgd(
    w0: np.ndarray, grads: list, alpha: float, tau: int, nesterov: bool
) -> tuple[list, np.ndarray]:
    k = len(grads)
    w = [w0.astype(np.float64).copy() for _ in range(k)]
    buf = [np.zeros_like(w[0]) for _ in range(k)]
    centre = w[0].copy()
    for t in range(STEPS):
        for j in range(k):  # torch SGD: buf ← μ buf + g; step g + μ buf (Nesterov) or buf
            buf[j] = MOMENTUM * buf[j] + grads[j][t]
            w[j] = w[j] - LR * (grads[j][t] + MOMENTUM * buf[j] if nesterov else buf[j])
        if (t + 1) % tau == 0:
            d = [w[j] - centre for j in range(k)]
            for j in range(k):
                w[j] = w[j] - alpha * d[j]
            centre = centre + alpha * sum(d)
    return w, centre


@pytest.mark.parametrize(("size", "learners"), [(1, 1), (2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("eamsgd", [False, True])
def test_easgd_sync_equals_numpy(size: int, learners: int, eamsgd: bool) -> None:
    hyper = {"tau": 3, "momentum": MOMENTUM} if eamsgd else {"tau": 3}
    w0, final, grads, rules = run(size, lambda: EASGD(**hyper), learners=learners)
    k = size * learners
    w, centre = numpy_easgd(w0, grads, alpha=0.9 / k, tau=3, nesterov=eamsgd)
    for g in range(k):
        np.testing.assert_allclose(final[g], w[g], rtol=1e-4, atol=1e-6)
    for rule in rules:
        np.testing.assert_allclose(rule.eval_params().numpy(), centre, rtol=1e-4, atol=1e-6)


def test_easgd_centre_moves_by_alpha_sum_of_differences() -> None:
    def body(comm: Communicator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        torch.manual_seed(0)
        pool = SerialPool(
            MLP(hidden=8), PoolSpec(comm.rank, comm.size, 8, OptimSection(lr=0.1), torch.device("cpu"))
        )
        rule = EASGD(alpha=0.2, tau=1).bind(comm, pool)
        pool.learners[0].params.add_(float(comm.rank + 1))  # x_i − x~ = rank + 1 everywhere
        before = rule.centre.numpy().copy()
        rule.exchange(0)
        return before, rule.centre.numpy().copy(), pool.learners[0].params.numpy().copy()

    results = InProcessWorld(3).run(body)
    before, after, _ = results[0]
    np.testing.assert_allclose(after - before, 0.2 * (1 + 2 + 3), rtol=1e-5)
    for r, (_, _, x) in enumerate(results):
        np.testing.assert_allclose(x - before, (r + 1) * (1 - 0.2), rtol=1e-5)


@pytest.mark.parametrize(
    ("cls", "hyper", "message"),
    [
        (SMA, {"alpha": 1.5}, r"\[rule\] alpha: 1.5 is out of range; must be <= 1"),
        (SMA, {"momentum": 1.0}, r"\[rule\] momentum: 1.0 is out of range; must be < 1"),
        (EASGD, {"tau": 0}, r"\[rule\] tau: 0 is out of range; must be >= 1"),
        (EASGD, {"alpha": "x"}, r"\[rule\] alpha: expected a number, got 'x'"),
    ],
)
def test_hyper_parameters_are_validated(cls: type, hyper: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cls(**hyper)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_sync_rules_equal_numpy_under_real_mpi(mpiexec: str, ranks: int) -> None:
    from conftest import run_mpi

    proc = run_mpi(mpiexec, ranks, [sys.executable, "tests/mpi_scripts/rules_check.py"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == [f"ok SMA {ranks}", f"ok EASGD {ranks}", f"ok EAMSGD {ranks}"]


@pytest.mark.parametrize("name", ["BSP", "SMA", "EASGD", "LOCALSGD", "DILOCO"])
def test_synchronous_rules_validate_one_model_with_the_mean_batchnorm_statistics(name: str) -> None:
    """After ``sync_state`` every rank of a synchronous rule holds the same BatchNorm running statistics,
    the mean of what the ranks trained: validation sums every rank's shard, so ranks validating the same
    weights with their own statistics would report a model nobody holds (and a checkpoint rank 0's)."""
    from models.resnet import ResNet20
    from mpicrossbow.rules import RULES

    pools = []
    for r in range(2):
        torch.manual_seed(0)
        model = ResNet20(dataset="digits", width=4)
        pools.append(SerialPool(model, PoolSpec(r, 2, 8, OptimSection(lr=LR), torch.device("cpu"), seed=1)))

    def body(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        pool = pools[comm.rank]
        rule = RULES.get(name)().bind(comm, pool)
        train_steps(pool, rule, 3)
        rule.finish()
        trained = pool.learners[0].buffers.clone()
        rule.sync_state()
        return trained, pool.learners[0].buffers.clone()

    (trained0, synced0), (trained1, synced1) = InProcessWorld(2, timeout_s=60).run(body)
    torch.testing.assert_close(synced0, synced1, rtol=0, atol=0)
    torch.testing.assert_close(synced0, (trained0 + trained1) / 2)
