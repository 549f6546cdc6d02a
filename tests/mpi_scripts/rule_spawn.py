"""Run as a plain Python process: rule.init() starts the MPI job itself; wait() returns or raises."""

import sys

from mpicrossbow import BSP
from mpicrossbow.job import JobFailed

out = sys.argv[1]
session = {"epochs": 2, "output": out, "progress": "off"}
rule = BSP()
rule.init(devices=["cpu0", "cpu1"], modelfile="models.mlp", modelclass="MLP", session=session)
print("status", rule.wait(), flush=True)
bad = BSP(mode="avg")
bad.init(devices="cpu0,cpu1", modelfile="models.mlp", modelclass="NoSuchModel", session=session)
try:
    bad.wait()
except JobFailed as exc:
    print("failed", exc.status, flush=True)
