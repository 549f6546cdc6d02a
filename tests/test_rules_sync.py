"""SMA and synchronous EASGD against their numpy references (tests/reference.py), fed the same gradients.

Each rank (a thread of the in-process world, sizes 1, 2 and 4) trains MLP replicas on its own digits shard
(:func:`conftest.run_world`); the gradient every learner computed at every step is recorded, and numpy
replays the rule's equations with those gradients. If the framework's weights and centre equal numpy's after
k steps, the framework computes exactly the equations (the gradients were taken at the framework's own
weights, which numpy reproduces).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch

import reference
from conftest import LR, MOMENTUM, NormedMLP, WorldRun, run_mpi, run_world, stacked
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import OptimSection
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import EASGD, RULES, SMA
from mpicrossbow.testing import InProcessWorld

STEPS = 9


def run(size: int, make_rule: Any, nesterov: bool = False, learners: int = 1) -> WorldRun:
    """STEPS steps of ``make_rule()`` on MLP replicas, ``learners`` per rank."""
    optim = OptimSection(lr=LR, momentum=MOMENTUM, nesterov=nesterov)
    return run_world(size, make_rule, STEPS, optim=optim, learners=learners)


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal to float32 round-off of the framework against numpy's float64."""
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("size", "learners"), [(1, 1), (2, 1), (4, 1), (1, 4), (2, 3)])
def test_sma_equals_numpy(size: int, learners: int) -> None:
    """Corrections summed in the rank, one allreduce: the same z as numpy's sum over all k learners."""
    out = run(size, lambda: SMA(momentum=0.5), learners=learners)
    k = size * learners
    alpha = out.rules[0].alpha  # SMA's default α for this k and μ (tests/test_sma_stability.py)
    assert alpha == pytest.approx(min(0.2, 0.9 * 3.0 / (k + 1.5)))
    w, z = reference.sma(out.w0, out.learner_grads(), reference.Sgd(LR, MOMENTUM), alpha=alpha, mu=0.5)
    for got, want in zip(out.learner_final(), w, strict=True):
        assert_close(got, want)
    for rule in out.rules:
        assert_close(rule.eval_params().numpy(), z)


def test_sma_with_zero_alpha_and_momentum_leaves_z_unchanged() -> None:
    out = run(2, lambda: SMA(alpha=0.0, momentum=0.0))
    for rule in out.rules:
        np.testing.assert_array_equal(rule.eval_params().numpy(), out.w0)
    assert not np.array_equal(out.final[0][0], out.w0)  # the learners did move


@pytest.mark.parametrize(("size", "learners"), [(1, 1), (2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("eamsgd", [False, True])
def test_easgd_sync_equals_numpy(size: int, learners: int, eamsgd: bool) -> None:
    hyper = {"tau": 3, "momentum": MOMENTUM} if eamsgd else {"tau": 3}
    out = run(size, lambda: EASGD(**hyper), learners=learners)
    k = size * learners
    sgd = reference.Sgd(LR, MOMENTUM, nesterov=eamsgd)
    w, centre = reference.easgd(out.w0, out.learner_grads(), sgd, alpha=0.9 / k, tau=3)
    for got, want in zip(out.learner_final(), w, strict=True):
        assert_close(got, want)
    for rule in out.rules:
        assert_close(rule.eval_params().numpy(), centre)


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


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_sync_rules_equal_numpy_under_real_mpi(mpiexec: str, ranks: int) -> None:
    proc = run_mpi(mpiexec, ranks, [sys.executable, "tests/mpi_scripts/rules_check.py"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == [f"ok SMA {ranks}", f"ok EASGD {ranks}", f"ok EAMSGD {ranks}"]


@pytest.mark.parametrize("name", ["BSP", "SMA", "EASGD", "LOCALSGD", "DILOCO"])
def test_synchronous_rules_validate_one_model_with_the_mean_batchnorm_statistics(name: str) -> None:
    """After ``sync_state`` every rank of a synchronous rule holds the same BatchNorm running statistics,
    the mean of what the ranks trained: validation sums every rank's shard, so ranks validating the same
    weights with their own statistics would report a model nobody holds (and a checkpoint rank 0's)."""
    out = run_world(
        2,
        RULES.get(name),
        3,
        model=lambda: NormedMLP(hidden=8),
        after_finish=lambda c, pool, r: stacked(pool, "buffers"),
    )
    trained = out.extra
    assert not np.array_equal(trained[0], trained[1])  # the ranks' statistics differed before
    for pool in out.pools:
        np.testing.assert_array_equal(stacked(pool, "buffers"), stacked(out.pools[0], "buffers"))
        np.testing.assert_allclose(stacked(pool, "buffers"), (trained[0] + trained[1]) / 2, rtol=1e-6)
