"""One embedded-API job for benchmarks/faults.py ``--elastic``: the digits network of examples/train_digits.py
trained in a plain loop of your own under ``xb.distribute(rule=...)``, timed per step, with an optional
SIGKILL of one rank.

    mpiexec --with-ft ulfm -n 4 python -m benchmarks.embedded_steps OUT RULE ELASTIC KILL_RANK KILL_STEP N

``ELASTIC`` is ``true`` or ``false`` (``xb.init(elastic=...)``); ``KILL_RANK`` (-1: none) SIGKILLs itself
right after its optimizer step number ``KILL_STEP`` (counted from 1 over the whole run); ``N`` epochs.
Rank 0 writes ``OUT`` (JSON): the seconds per step of the epochs after the first (the first warms up) —
their mean, and the median of the single steps' times (from one ``optimizer.step()``'s end to the next's: on
a shared machine a preempted step moves the mean, hardly the median) — the steps its loop ran and the world
size at the end (an ``xb.allreduce`` over the survivors). What a loss
dropped is rank 0's ``elastic: lost rank(s)`` line.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mpicrossbow as xb  # noqa: E402
from examples import train_digits as example  # noqa: E402


def main() -> None:
    out, rule, elastic = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "true"
    kill_rank, kill_step, epochs = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    world = xb.init(elastic=elastic)
    torch.manual_seed(1)
    train_set, _, model = example.datasets_and_model("digits")
    loader = xb.shard(train_set, 16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = xb.distribute(model, optimizer, rule=rule)
    step, timed, started, singles = 0, 0, 0.0, []
    for epoch in range(epochs):
        if epoch == 1:  # the first epoch warms up
            started, timed = time.perf_counter(), 0
        last = time.perf_counter()
        for data, target in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            step, timed, now = step + 1, timed + 1, time.perf_counter()
            if epoch:
                singles.append(now - last)
            last = now
            if world.rank == kill_rank and step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
    seconds = time.perf_counter() - started
    size = xb.allreduce(1, op="sum")
    xb.finish()
    if xb.init().rank == 0:
        median = statistics.median(singles) if singles else float("nan")
        result = {"s_per_step": seconds / max(timed, 1), "median_s": median, "steps": step, "size": size}
        out.write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()
