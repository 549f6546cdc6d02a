"""Run inside ``mpiexec -n 2``: BSP through rule.init()/rule.wait(), then rank 0 saves the final weights."""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mpicrossbow import BSP

out = Path(sys.argv[1])
rule = BSP(mode="grad")
rule.init(
    devices=["cpu0", "cpu1"],
    modelfile="models.mlp",
    modelclass="MLP",
    session={"steps": 12, "seed": 3, "output": str(out), "name": "union", "progress": "off"},
    optim={"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
    data={"batch_size": 8},
    model={"hidden": 32},
)
result = rule.wait()
if rule.comm.rank == 0:
    np.save(out / "params.npy", rule.pool.learners[0].params.numpy())
    (out / "result.json").write_text(json.dumps(asdict(result)))
