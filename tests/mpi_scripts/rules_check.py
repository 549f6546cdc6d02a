"""Run under ``mpiexec -n N``: SMA and synchronous EASGD over real MPI against the numpy equations.

Every rank trains an MLP replica on its digits shard with MPICommunicator; rank 0 gathers the recorded
gradients and final weights and replays the rules in numpy (tests/reference.py, as test_rules_sync.py does).
Prints one ``ok <case>`` line per case that matches, and exits non-zero on the first mismatch.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the numpy references and conftest

import reference
from conftest import LR, MOMENTUM, train_steps
from models.mlp import MLP
from mpicrossbow.comm.mpi import MPICommunicator
from mpicrossbow.config import OptimSection
from mpicrossbow.dynamo_on_demand import spare_dynamo
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import EASGD, SMA

spare_dynamo()  # as crossbow-launch's ranks: the optimizers below need not import the compiler

STEPS = 9

world = MPI.COMM_WORLD
comm = MPICommunicator(world)
size = world.size
CASES = {
    "SMA": (lambda: SMA(momentum=0.5), False),
    "EASGD": (lambda: EASGD(tau=3), False),
    "EAMSGD": (lambda: EASGD(tau=3, momentum=MOMENTUM), True),
}
for name, (make_rule, nesterov) in CASES.items():
    torch.manual_seed(world.rank)
    optim = OptimSection(lr=LR, momentum=MOMENTUM, nesterov=nesterov)
    pool = SerialPool(MLP(hidden=16), PoolSpec(world.rank, size, 8, optim, torch.device("cpu"), seed=1))
    rule = make_rule().bind(comm, pool)
    start = pool.learners[0].params.numpy().copy()
    grads = [per_learner[0] for per_learner in train_steps(pool, rule, STEPS)]
    rule.finish()
    gathered = world.gather(
        (grads, pool.learners[0].params.numpy().copy(), rule.eval_params().numpy().copy())
    )
    if world.rank == 0:
        all_grads = [g for g, _, _ in gathered]
        sgd = reference.Sgd(LR, MOMENTUM, nesterov=nesterov)
        if name == "SMA":
            alpha = rule.alpha  # SMA's default α for k = size learners and μ = 0.5 (min(0.2, 0.9 × bound))
            want_w, want_centre = reference.sma(start, all_grads, sgd, alpha=alpha, mu=0.5)
        else:
            want_w, want_centre = reference.easgd(start, all_grads, sgd, alpha=0.9 / size, tau=3)
        for r, (_, w, centre) in enumerate(gathered):
            np.testing.assert_allclose(w, want_w[r], rtol=1e-4, atol=1e-6, err_msg=f"{name} rank {r}")
            np.testing.assert_allclose(centre, want_centre, rtol=1e-4, atol=1e-6, err_msg=f"{name} centre")
        print(f"ok {name} {size}", flush=True)
sys.exit(0)
