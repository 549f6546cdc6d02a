"""``xb.checkpoint`` in your own elastic loop, with a rank SIGKILLed inside one of them.

    mpiexec --with-ft ulfm -n 4 python tests/mpi_scripts/embedded_checkpoint_loss.py OUT KILL_RANK KILL_SAVE \
        [RULE]

A small loop under ``RULE`` (default BSP) and ``xb.init(elastic=True)``: 30 optimizer steps,
``xb.checkpoint(OUT/ckpt)`` after every 10th (the same folder each time, as a script that keeps only its
latest). Start rank ``KILL_RANK`` (-1: none) SIGKILLs itself in its ``KILL_SAVE``-th checkpoint (1-based),
just before it writes its rank file: the others have entered the checkpoint and meet the loss in its
collectives. After ``xb.finish`` every rank writes ``OUT/rank-<rank>.pt``: its rank, the world size it
ended in and its flat weights.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mpicrossbow as xb  # noqa: E402
from mpicrossbow.embed import embedded_job  # noqa: E402

STEPS, EVERY = 30, 10


def kill_inside_save(start_rank: int, kill_rank: int, kill_save: int) -> None:
    """Wrap the job's file writer: on ``kill_rank``, SIGKILL before its ``kill_save``-th rank file."""
    write = embedded_job.atomic_save
    saves = [0]

    def atomic_save(state: Any, path: Path) -> None:
        if path.name.startswith("rank-"):
            saves[0] += 1
            if start_rank == kill_rank and saves[0] == kill_save:
                os.kill(os.getpid(), signal.SIGKILL)
        write(state, path)

    embedded_job.atomic_save = atomic_save  # type: ignore[assignment]


def main() -> None:
    out, kill_rank, kill_save = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rule = sys.argv[4] if len(sys.argv) > 4 else "BSP"
    world = xb.init(elastic=True)
    kill_inside_save(world.rank, kill_rank, kill_save)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = xb.distribute(model, optimizer, rule=rule)
    data = torch.Generator().manual_seed(world.rank)
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 8, generator=data)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % EVERY == 0:
            xb.checkpoint(out / "ckpt")
    xb.finish()
    world = xb.init()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = {"rank": world.rank, "size": world.size, "weights": weights}
    torch.save(state, out / f"rank-{world.rank}.pt")


if __name__ == "__main__":
    main()
