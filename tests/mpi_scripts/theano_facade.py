"""Theano-MPI's way, end to end: a Theano-form model (models/legacy_mlp.py) under BSP, EASGD with a server,
GOSGD and SMA, each started with ``rule.init(devices=..., modelfile=..., modelclass=...)`` and ``wait()``.

    mpiexec -n N python tests/mpi_scripts/theano_facade.py OUT     (init joins the running world)
    python tests/mpi_scripts/theano_facade.py OUT                  (init starts an MPI job of 2 ranks)

Each rule trains into ``OUT/<rule>``; rank 0 (or the plain process) prints ``RAN <rule> <accuracy>`` with the
final validation accuracy from its metrics.h5, then ``DONE``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mpicrossbow import BSP, EASGD, GOSGD, SMA
from mpicrossbow.training.reporting.metrics import read_metrics

RULES = (("BSP", BSP, {}), ("EASGD", EASGD, {"mode": "async"}), ("GOSGD", GOSGD, {}), ("SMA", SMA, {}))


def main(out: Path) -> None:
    inside = any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
    first = not inside or int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0
    for name, cls, hyper in RULES:
        rule = cls(**hyper)
        session = {"output": str(out / name), "epochs": 10, "progress": "off"}
        rule.init(
            devices="cpu" if inside else "cpu0,cpu1",
            modelfile="models.legacy_mlp",
            modelclass="LegacyMLP",
            session=session,
        )
        rule.wait()
        if first:
            (run,) = (out / name).iterdir()
            accuracy = float(read_metrics(run / "metrics.h5")["attrs"]["val_accuracy"])
            print(f"RAN {name} {accuracy:.4f}", flush=True)
    if first:
        print("DONE", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
