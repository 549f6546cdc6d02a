"""Several digits jobs (launch/digits.cfg) one after another in one MPI job, so torch starts once per rank.

    mpiexec -n 4 python tests/mpi_scripts/digits_runs.py OUT LABEL=override,override ... -- common overrides

Each run trains with the launcher's own ``run_rank`` (the same code path as ``crossbow-launch``) and writes
its run folder under ``OUT/LABEL``; the overrides after ``--`` apply to every run. Rank 0 prints
``RAN <label>`` after each run and ``DONE`` at the end; a failing run aborts the whole job, as it would alone.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from mpicrossbow.config import load_config
from mpicrossbow.training.runner import run_rank


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    split = rest.index("--") if "--" in rest else len(rest)
    runs, common = rest[:split], rest[split + 1 :]
    for spec in runs:
        label, _, overrides = spec.partition("=")
        config = load_config(
            "launch/digits.cfg",
            [
                *filter(None, overrides.split(",")),
                *common,
                f"session.output={out}/{label}",
                "session.progress=off",
            ],
        )
        code = run_rank(config)
        if code:
            return code
        if MPI.COMM_WORLD.rank == 0:
            print(f"RAN {label}", flush=True)
    if MPI.COMM_WORLD.rank == 0:
        print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
