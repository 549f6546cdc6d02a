"""Run as ``mpiexec -n N python -m mpi4py gosgd_check.py``: GOSGD under real MPI, checked by rank 0.

1. The deterministic schedule with per-rank jitter: rank 0 gathers every learner's recorded gradients and
   compares the weights, gossip weights and average model with the numpy reference (tests/reference.py),
   through test_gosgd's check.
2. Random gossip (p = 0.3), uneven delays and step counts: finish() returns everywhere and the allgathered
   weights sum to exactly 1.0. The second rule binds the same communicator, so the first left no receive
   posted.
"""

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: test_gosgd's run and check

from test_gosgd import STEPS, check_against_numpy, scheduled_run

from models.mlp import MLP
from mpicrossbow.comm.mpi import MPICommunicator
from mpicrossbow.config import OptimSection
from mpicrossbow.dynamo_on_demand import spare_dynamo
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import GOSGD
from mpicrossbow.training.run.step import train_step

spare_dynamo()  # as crossbow-launch's ranks: the optimizers below need not import the compiler

torch.set_num_threads(1)
comm = MPICommunicator()
jitter = random.Random(comm.rank)
result = scheduled_run(comm, STEPS, lambda: jitter.uniform(0, 0.01 * comm.rank))
results = comm.mpi.gather(result, root=0)
if comm.rank == 0:
    check_against_numpy(results)

pool = SerialPool(
    MLP(hidden=16), PoolSpec(comm.rank, comm.size, 8, OptimSection(lr=0.05), torch.device("cpu"), seed=1)
)
rule = GOSGD(p=0.3, seed=11).bind(comm, pool)
pool.start_epoch(0)
for step in range(25 + 5 * comm.rank):
    time.sleep(jitter.uniform(0, 0.003 * (comm.size - comm.rank)))
    train_step(pool, rule, step, step)
rule.finish()
weights = comm.mpi.allgather(rule.weight)
sent = comm.mpi.allgather(rule.sent)
assert sum(weights) == 1.0, weights
received = comm.mpi.allgather(sum(rule.received))
assert received == [sum(s[r] for s in sent) for r in range(comm.size)], (received, sent)
rule.sync_state()
comm.mpi.Barrier()
if comm.rank == 0:
    print(
        f"GOSGD MPI check passed on {comm.size} ranks; weights {weights}, messages {sum(received)}",
        flush=True,
    )
