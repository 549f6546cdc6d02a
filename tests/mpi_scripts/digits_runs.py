"""Several digits jobs (launch/digits.cfg) one after another in one MPI job, so torch starts once per rank.

    mpiexec -n 4 python tests/mpi_scripts/digits_runs.py OUT LABEL=override,override ... -- common overrides

Each run trains with the launcher's own ``run_rank`` (the same code path as ``crossbow-launch``) and writes
its run folder under ``OUT/LABEL``; the overrides after ``--`` apply to every run. Rank 0 prints
``RAN <label>`` after each run and ``DONE`` at the end; a failing run aborts the whole job, as it would alone.
Before ``DONE`` it says on stderr which ranks imported the compiler, ``torch._dynamo`` (``COMPILER imported on
ranks [...]``): none should, since none compiles (mpicrossbow.dynamo_on_demand).

With ``LINK_COUNTERS=IFACE`` in the environment (nodes of tests/netns_cluster.py), rank 0 also prints
``LINK <label> <host>=<bytes> ...`` before the first run (label ``start``) and after each: the bytes sent plus
received so far on each host's interface IFACE (read from ``/proc/net/dev`` of the rank's own network
namespace), so a test can tell what each run moved between nodes.
"""

from __future__ import annotations

import os
import socket
import sys

from mpi4py import MPI

from mpicrossbow.config import load_config
from mpicrossbow.training.run.runner import run_rank


def link_bytes(interface: str) -> int:
    """Bytes received plus sent on ``interface`` in this process's network namespace (0: no such one)."""
    with open("/proc/net/dev", encoding="utf-8") as dev:
        for line in dev:
            name, _, fields = line.partition(":")
            if name.strip() == interface:
                values = fields.split()
                return int(values[0]) + int(values[8])
    return 0


def report_links(label: str) -> None:
    """Rank 0 prints every host's link counter (collective; nothing without LINK_COUNTERS)."""
    interface = os.environ.get("LINK_COUNTERS")
    if not interface:
        return
    counts = dict(MPI.COMM_WORLD.allgather((socket.gethostname(), link_bytes(interface))))
    if MPI.COMM_WORLD.rank == 0:
        print(f"LINK {label} " + " ".join(f"{h}={b}" for h, b in sorted(counts.items())), flush=True)


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    split = rest.index("--") if "--" in rest else len(rest)
    runs, common = rest[:split], rest[split + 1 :]
    report_links("start")
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
        report_links(label)
        if MPI.COMM_WORLD.rank == 0:
            print(f"RAN {label}", flush=True)
    compiled = MPI.COMM_WORLD.allgather("torch._dynamo" in sys.modules)
    if MPI.COMM_WORLD.rank == 0:
        print(f"COMPILER imported on ranks {[r for r, c in enumerate(compiled) if c]}", file=sys.stderr)
        print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
