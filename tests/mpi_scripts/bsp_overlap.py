"""Run inside ``mpiexec -n N``: BSP gradient mode over the real MPI communicator, with buckets and without.

For each learner count (1, 2) and bucket size (0 = one allreduce, a bucket smaller than the largest
parameter, one per parameter, one for all) every rank trains its pool for a few steps; rank 0 gathers the
final weights and writes a JSON report: whether every replica of every rank ended identical, whether each
bucketed run equals the one-allreduce run bitwise (and the largest difference if not), and the largest
difference to one process trained on the union of every learner's batches.
"""

import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from models.mlp import MLP
from mpicrossbow.comm.mpi import MPICommunicator
from mpicrossbow.config import OptimSection
from mpicrossbow.dynamo_on_demand import spare_dynamo
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP
from mpicrossbow.training.run.step import train_step

spare_dynamo()  # as crossbow-launch's ranks: the optimizers below need not import the compiler

STEPS, BATCH = 6, 8
OPTIM = OptimSection(lr=0.1, momentum=0.9, weight_decay=1e-3)
BUCKETS = (0.0, 0.004, 1e-5, 100.0)

torch.set_num_threads(1)
comm = MPICommunicator(MPI.COMM_WORLD)
rank, size = comm.rank, comm.size


def pool_for(r: int, learners: int) -> SerialPool:
    torch.manual_seed(r + 100)  # different initial replicas: bind() must broadcast rank 0's
    return SerialPool(
        MLP(hidden=32), PoolSpec(r, size, BATCH, OPTIM, torch.device("cpu"), seed=5, learners=learners)
    )


def train(learners: int, bucket_mb: float) -> list[np.ndarray]:
    pool = pool_for(rank, learners)
    rule = BSP(mode="grad", bucket_mb=bucket_mb).bind(comm, pool)
    pool.start_epoch(0)
    for step in range(STEPS):
        train_step(pool, rule, step, step)
    rule.finish()
    mine = [learner.params.numpy().copy() for learner in pool.learners]
    return [p for part in MPI.COMM_WORLD.allgather(mine) for p in part]


def union(learners: int) -> np.ndarray:
    pools = [pool_for(r, learners) for r in range(size)]
    module = copy.deepcopy(pools[0].learners[0].module)
    opt = torch.optim.SGD(module.parameters(), lr=OPTIM.lr, momentum=OPTIM.momentum, weight_decay=1e-3)
    iters = [iter(d.train_batches(0)) for p in pools for d in p.datas]
    for _ in range(STEPS):
        batches = [next(it) for it in iters]
        opt.zero_grad()
        out = module(torch.cat([b[0] for b in batches]))
        torch.nn.functional.cross_entropy(out, torch.cat([b[1] for b in batches])).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()


report = []
for learners in (1, 2):
    runs = {mb: train(learners, mb) for mb in BUCKETS}
    if rank == 0:
        plain = runs[0.0][0]
        reference = union(learners)
        for mb, final in runs.items():
            report.append(
                {
                    "learners": learners,
                    "bucket_mb": mb,
                    "replicas_identical": all(np.array_equal(p, final[0]) for p in final),
                    "equal_to_plain": bool(np.array_equal(final[0], plain)),
                    "max_diff_to_plain": float(np.abs(final[0] - plain).max()),
                    "max_diff_to_union": float(np.abs(final[0] - reference).max()),
                }
            )
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
