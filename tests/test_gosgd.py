"""GOSGD against its numpy reference (tests/reference.py), exact weights, termination, real MPI.

With a deterministic schedule every rank knows which messages it must merge at each step, so the result is
reproducible and numpy can replay the equations with the gradients each learner recorded. With random
gossip, uneven delays and uneven step counts, ``finish()`` must return on every rank with Σ a_i == 1.0
exactly, and without local steps gossip must preserve the weighted average Σ a_i x_i.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import reference
from conftest import LR, MOMENTUM, run_mpi
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import OptimSection
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import GOSGD
from mpicrossbow.rules.gosgd import UNIT
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.run.step import train_step

STEPS = 10


def make_schedule(size: int) -> Callable[[int, int], int | None]:
    """A schedule with idle steps, one-to-one sends and steps where every other rank sends to rank 0."""

    def schedule(step: int, rank: int) -> int | None:
        if size == 1 or step % 3 == 2:
            return None
        if step % 4 == 1:
            return 0 if rank else 1
        return (rank + 1 + step % (size - 1)) % size

    return schedule


def scheduled_run(
    comm: Communicator, steps: int, delay: Callable[[], float] = lambda: 0.0, learners: int = 1
) -> dict[str, Any]:
    """Train MLP replicas with the deterministic schedule; return what numpy needs and what GOSGD got."""
    torch.manual_seed(comm.rank)
    optim = OptimSection(lr=LR, momentum=MOMENTUM)
    pool = SerialPool(
        MLP(hidden=16),
        PoolSpec(comm.rank, comm.size, 8, optim, torch.device("cpu"), seed=1, learners=learners),
    )
    rule = GOSGD(schedule=make_schedule(comm.size * learners)).bind(comm, pool)
    out: dict[str, Any] = {
        "start": pool.learners[0].params.numpy().copy(),
        "grads": [[] for _ in range(learners)],
    }
    pool.start_epoch(0)

    def record(step: int) -> None:
        for j, learner in enumerate(pool.learners):
            out["grads"][j].append(learner.grads.numpy().copy())

    for step in range(steps):
        time.sleep(delay())  # uneven arrivals between one exchange and the next
        train_step(pool, rule, step, step, record)
    rule.finish()
    assert rule.eval_params() is None
    rule.sync_state()
    average = rule.eval_params()
    assert average is not None
    out.update(
        final=[learner.params.numpy().copy() for learner in pool.learners],
        masses=list(rule.masses),
        average=average.numpy().copy(),
    )
    return out


def check_against_numpy(results: list[dict[str, Any]]) -> None:
    """Every learner's weights and gossip weight, and the average model, equal numpy's replay."""
    k = sum(len(r["masses"]) for r in results)
    assert all(np.array_equal(r["start"], results[0]["start"]) for r in results)
    grads = [g for r in results for g in r["grads"]]  # global learner order: rank-major
    x, mass = reference.gosgd(results[0]["start"], grads, reference.Sgd(LR, MOMENTUM), make_schedule(k))
    assert [m for r in results for m in r["masses"]] == mass and sum(mass) == UNIT
    final = [f for r in results for f in r["final"]]
    for g in range(k):
        np.testing.assert_allclose(final[g], x[g], rtol=1e-4, atol=1e-6)
    average = sum(m / UNIT * xg for m, xg in zip(mass, x, strict=True))
    for result in results:
        np.testing.assert_allclose(result["average"], average, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("size", "learners"), [(1, 1), (2, 1), (4, 1), (1, 3), (2, 2), (2, 3)])
def test_scheduled_gosgd_equals_numpy(size: int, learners: int) -> None:
    """Learners of one rank gossip in memory, of different ranks through messages: numpy's equations both."""
    results = InProcessWorld(size).run(lambda comm: scheduled_run(comm, STEPS, learners=learners))
    check_against_numpy(results)
    if size * learners > 1:  # gossip did happen: the replicas differ
        final = [f for r in results for f in r["final"]]
        assert not np.array_equal(final[0], final[1])


def fake_pool(params: torch.Tensor, learners: int = 1) -> Any:
    """The part of a pool GOSGD touches: learners with flat params and (empty) buffers."""
    return SimpleNamespace(
        learners=[SimpleNamespace(params=params.clone(), buffers=torch.zeros(0)) for _ in range(learners)]
    )


@pytest.mark.parametrize(("size", "learners"), [(3, 1), (4, 1), (2, 3)])
def test_random_gossip_terminates_with_weights_summing_to_exactly_one(size: int, learners: int) -> None:
    n = 257
    initial = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def body(comm: Communicator) -> tuple[float, list[int], list[int], np.ndarray]:
        pool = fake_pool(torch.zeros(n), learners)
        rule = GOSGD(p=0.5, seed=7).bind(comm, pool)
        for learner in pool.learners:  # no local steps: Σ a_i x_i is invariant
            learner.params.copy_(initial[comm.rank])
        jitter = random.Random(comm.rank)
        for step in range(30 + 3 * comm.rank):  # uneven step counts and per-rank delays
            time.sleep(jitter.uniform(0, 0.002 * (comm.rank + 1)))
            rule.exchange(step)
        rule.finish()
        rule.sync_state()
        return rule.weight, rule.sent, rule.received, rule.eval_params().numpy()

    results = InProcessWorld(size, timeout_s=20).run(body)
    weights = [w for w, *_ in results]
    assert sum(weights) == 1.0 and all(w > 0 for w in weights)
    sent = np.sum([s for _, s, _, _ in results], axis=0)
    received = np.sum([r for _, _, r, _ in results], axis=0)
    assert sent.sum() > 20 and sent.tolist() == [sum(r[2]) for r in results]
    assert received.tolist() == [sum(r[1]) for r in results]
    mean = torch.stack(initial).double().mean(0).numpy()
    for *_, average in results:
        np.testing.assert_allclose(average, mean, rtol=1e-5, atol=1e-5)


def test_random_draws_are_reproducible_and_checkpointed() -> None:
    def body(comm: Communicator) -> list[list[int]]:
        runs = []  # what each rank sent where (the weights depend on arrival times)
        for _ in range(2):
            rule = GOSGD(p=0.3, seed=3).bind(comm, fake_pool(torch.zeros(4)))
            for step in range(20):
                rule.exchange(step)
            rule.finish()
            runs.append(rule.sent)
        state = rule.state_dict()
        fresh = GOSGD(p=0.3, seed=3).bind(comm, fake_pool(torch.zeros(4)))
        fresh.load_state_dict(state)
        assert fresh.rng.random() == rule.rng.random() and fresh.mass == rule.mass
        fresh.finish()
        return runs

    for first, second in InProcessWorld(3).run(body):
        assert first == second


def test_errors() -> None:
    def self_send(comm: Communicator) -> None:
        GOSGD(schedule=lambda step, rank: rank).bind(comm, fake_pool(torch.zeros(3))).exchange(0)

    with pytest.raises(ValueError, match=r"schedule\(0, (\d)\) = \1 is not another learner"):
        InProcessWorld(2).run(self_send)
    rule = GOSGD()
    assert not rule.synchronous and rule.hyper.p == 0.01


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_gosgd_under_real_mpi(mpiexec: str, ranks: int) -> None:
    script = "tests/mpi_scripts/gosgd_check.py"
    proc = run_mpi(mpiexec, ranks, [sys.executable, "-m", "mpi4py", script], timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"GOSGD MPI check passed on {ranks} ranks" in proc.stdout, proc.stdout
