"""BSP against references: gradient mode equals one process on the union of the ranks' batches; parameter
mode equals independent local steps followed by a plain numpy mean. World sizes 1, 2 and 4 run in-process."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from models.mlp import MLP
from mpicrossbow.comm.inprocess import InProcessWorld
from mpicrossbow.config import OptimSection
from mpicrossbow.pool import SerialPool
from mpicrossbow.rules import BSP

STEPS = 6
BATCH = 8
OPTIM = OptimSection(lr=0.1, momentum=0.9, weight_decay=1e-3)


def make_pool(rank: int, size: int, learners: int = 1) -> SerialPool:
    torch.manual_seed(rank + 100)  # different initial replicas: bind() must broadcast rank 0's
    return SerialPool(
        MLP(hidden=32), rank, size, BATCH, OPTIM, torch.device("cpu"), seed=5, learners=learners
    )


def train_bsp(size: int, mode: str, learners: int = 1) -> list[np.ndarray]:
    """Final flat parameters of every learner of every rank after STEPS steps of BSP in ``mode``."""
    pools = [make_pool(r, size, learners) for r in range(size)]
    initial = pools[0].learners[0].params.clone()

    def body(comm):
        pool = pools[comm.rank]
        rule = BSP(mode=mode).bind(comm, pool)
        pool.start_epoch(0)
        for step in range(STEPS):
            pool.compute(step)
            rule.on_gradients(step)
            pool.apply()
            rule.exchange(step)
        return [learner.params.numpy().copy() for learner in pool.learners]

    final = [params for per_rank in InProcessWorld(size).run(body) for params in per_rank]
    assert not torch.equal(initial, torch.from_numpy(final[0]))
    return final


def union_reference(size: int, learners: int = 1) -> np.ndarray:
    """One process, one replica (rank 0's initial weights), each step on every learner's batch at once."""
    pools = [make_pool(r, size, learners) for r in range(size)]
    module = copy.deepcopy(pools[0].learners[0].module)
    opt = torch.optim.SGD(
        module.parameters(), lr=OPTIM.lr, momentum=OPTIM.momentum, weight_decay=OPTIM.weight_decay
    )
    iters = [iter(data.train_batches(0)) for p in pools for data in p.datas]
    for _ in range(STEPS):
        batches = [next(it) for it in iters]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()


@pytest.mark.parametrize(("size", "learners"), [(1, 1), (2, 1), (4, 1), (1, 3), (2, 2)])
def test_grad_mode_equals_one_process_on_the_union_of_batches(size: int, learners: int) -> None:
    """k = ranks × learners: the mean gradient over every learner of every rank, replicas identical."""
    final = train_bsp(size, "grad", learners)
    assert len(final) == size * learners
    for params in final[1:]:
        np.testing.assert_array_equal(params, final[0])  # replicas stay identical
    np.testing.assert_allclose(final[0], union_reference(size, learners), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_avg_mode_equals_local_steps_then_numpy_mean(size: int) -> None:
    final = train_bsp(size, "avg")
    pools = [make_pool(r, size) for r in range(size)]
    start = pools[0].learners[0].params.clone()
    for p in pools:
        p.learners[0].params.copy_(start)
        p.start_epoch(0)
    for step in range(STEPS):
        for p in pools:
            p.compute(step)
            p.apply()
        mean = np.mean([p.learners[0].params.numpy() for p in pools], axis=0)
        for p in pools:
            p.learners[0].params.copy_(torch.from_numpy(mean))
    np.testing.assert_allclose(final[0], mean, rtol=1e-5, atol=1e-6)
    for params in final[1:]:
        np.testing.assert_array_equal(params, final[0])


def test_bsp_rejects_unknown_mode() -> None:
    from mpicrossbow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"mode.*grad"):
        BSP(mode="sum")
