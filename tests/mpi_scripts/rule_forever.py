"""Run as a plain Python process: start a long job with rule.init(), say so, and wait (to be interrupted)."""

import sys

from mpicrossbow import BSP

rule = BSP()
session = {"epochs": 100000, "output": sys.argv[1], "progress": "off"}
rule.init(devices=["cpu0", "cpu1"], modelfile="models.mlp", modelclass="MLP", session=session)
print("started", flush=True)
rule.wait()
