"""Several cfg files trained one after another in one MPI job, so torch starts once per rank.

    mpiexec -n 2 python tests/mpi_scripts/cfg_runs.py OUT LABEL=CFG[,override...] ... [-- common overrides]

Each run goes through ``run_rank`` (crossbow-launch's own path) into ``OUT/LABEL``; rank 0 prints
``RAN <label> <final validation accuracy>`` after each and ``DONE`` at the end. A failing run aborts the job
(or, for bad input, ends every rank with its one line), as it would alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mpi4py import MPI

from mpicrossbow.config import load_config
from mpicrossbow.training.reporting.metrics import read_metrics
from mpicrossbow.training.run.runner import run_rank


def main(argv: list[str]) -> int:
    out, rest = Path(argv[0]), argv[1:]
    split = rest.index("--") if "--" in rest else len(rest)
    runs, common = rest[:split], rest[split + 1 :]
    for spec in runs:
        label, _, given = spec.partition("=")
        path, *overrides = given.split(",")
        quiet = [
            "session.progress=off",
            f"session.output={out / label}",
        ]  # a run's overrides may say otherwise
        config = load_config(path, [*quiet, *common, *overrides])
        code = run_rank(config)
        if code:
            return code
        if MPI.COMM_WORLD.rank == 0:
            (run,) = (out / label).iterdir()
            accuracy = float(read_metrics(run / "metrics.h5")["attrs"]["val_accuracy"])
            print(f"RAN {label} {accuracy:.4f}", flush=True)
    if MPI.COMM_WORLD.rank == 0:
        print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
