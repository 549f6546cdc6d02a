"""Run as a plain Python process: rule.init() starts the MPI job itself; wait() returns or raises.

Usage: rule_spawn.py OUT_DIR FAILING_MODEL_FILE. Three jobs, each in its own folder under OUT_DIR: the digits
job to the end (ok/), a model class that does not exist (missing/), and a model whose rank 1 raises while
training (crash/). Prints one line per job.
"""

import sys
from pathlib import Path

from mpicrossbow import BSP
from mpicrossbow.compat.jobs import JobFailed

out, failing = Path(sys.argv[1]), sys.argv[2]
rule = BSP()
rule.init(
    devices=["cpu0", "cpu1"],
    modelfile="models.mlp",
    modelclass="MLP",
    cfg="launch/digits.cfg",
    session={"output": str(out / "ok"), "progress": "off"},
)
print("status", rule.wait(), flush=True)
for name, modelfile, modelclass in (
    ("missing", "models.mlp", "NoSuchModel"),
    ("crash", failing, "FailingMLP"),
):
    bad = BSP(mode="avg")
    session = {"epochs": 2, "output": str(out / name), "progress": "off"}
    bad.init(devices="cpu0,cpu1", modelfile=modelfile, modelclass=modelclass, session=session)
    try:
        bad.wait()
    except JobFailed as exc:
        print(name, exc.status, exc, flush=True)
