"""A user's script that goes wrong on rank 1 only, under the embedded API (must end, never hang).

    mpiexec -n 2 python tests/mpi_scripts/embedded_fail.py raise        rank 1 raises at its 5th step
    mpiexec -n 2 python tests/mpi_scripts/embedded_fail.py unfinished   rank 1 leaves without xb.finish()

Every other rank keeps training under BSP (it waits in rank 1's allreduce), so only the failure protocol can
end the job: one line naming rank 1, a non-zero status on every rank.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

import mpicrossbow as xb


def main(mode: str) -> None:
    world = xb.init(devices="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = xb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), rule="BSP")
    for step in range(100_000):
        if world.rank == 1 and step == 5:
            if mode == "raise":
                raise RuntimeError("injected failure in the user's loop")
            return  # "unfinished": out of the script without xb.finish()
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
        optimizer.step()
    xb.finish()


if __name__ == "__main__":
    main(sys.argv[1])
