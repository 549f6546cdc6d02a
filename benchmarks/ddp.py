"""BSP (gradient mode, one flat MPI allreduce per step) against torch DistributedDataParallel (Gloo).

Same model, same initial weights, same batches, same SGD; the two loops alternate round by round in one run
so machine noise hits both alike. Reports samples/s per rank-set (median over rounds) and the ratio.

    python benchmarks/ddp.py                 # re-launches itself with mpiexec -n 2
    mpiexec -n 2 python benchmarks/ddp.py --rounds 7 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import append_result, relaunch, under_mpi


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks when re-launching under mpiexec")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed rounds per method")
    parser.add_argument("--steps", type=int, default=20, help="training steps per round")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    return parser.parse_args(argv)


def models() -> dict[str, tuple[object, tuple[int, ...]]]:
    """Benchmark models: name → (model-file object, input shape)."""
    from models.lenet import LeNet
    from models.mlp import MLP

    return {
        "LeNet (28x28)": (LeNet(dataset="mnist", image_size=28), (1, 28, 28)),
        "MLP 784-1024x3-10": (MLP(hidden=1024, layers=3, inputs=784), (1, 28, 28)),
    }


def measure(
    model: Any, shape: tuple[int, ...], args: argparse.Namespace, comm: Any
) -> tuple[float, float, int]:
    """Samples/s of BSP and of DDP (median over alternating rounds) and the parameter count."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from mpicrossbow.config import OptimSection
    from mpicrossbow.pool.learner import Learner
    from mpicrossbow.rules import BSP

    world = comm.mpi
    optim = OptimSection(lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(world.rank)
    batches = [
        (torch.randn(args.batch, *shape, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
        for _ in range(args.steps)
    ]
    torch.manual_seed(0)
    learner = Learner(model.module(), model, optim, torch.device("cpu"))
    pool = SimpleNamespace(learners=[learner], has_gradients=True)  # the pool face BSP needs
    rule = BSP(mode="grad").bind(comm, pool)  # type: ignore[arg-type]
    torch.manual_seed(0)
    ddp_module = DistributedDataParallel(model.module())
    ddp_opt = torch.optim.SGD(ddp_module.parameters(), lr=optim.lr, momentum=optim.momentum)

    def bsp_round() -> None:
        for step, (x, y) in enumerate(batches):
            learner.forward_backward(x, y)
            rule.on_gradients(step)
            learner.step()

    def ddp_round() -> None:
        for x, y in batches:
            ddp_opt.zero_grad(set_to_none=False)
            model.loss(ddp_module(x), y).backward()
            ddp_opt.step()

    times: dict[str, list[float]] = {"bsp": [], "ddp": []}
    order = [("bsp", bsp_round), ("ddp", ddp_round)]
    for r in range(args.rounds + 1):  # round 0 warms up
        for key, fn in order if r % 2 == 0 else order[::-1]:
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            world.Barrier()
            if r:
                times[key].append(time.perf_counter() - t0)
    n = args.steps * args.batch * world.size
    return n / statistics.median(times["bsp"]), n / statistics.median(times["ddp"]), learner.params.numel()


def main() -> int:
    args = parse_args(sys.argv[1:])
    if not under_mpi():
        return relaunch(__file__, args.ranks, sys.argv[1:])
    import torch
    from mpi4py import MPI

    from mpicrossbow.comm.mpi import MPICommunicator
    from mpicrossbow.comm.torchdist import TorchDistCommunicator

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = MPICommunicator(world)
    gloo = TorchDistCommunicator.from_mpi(world, backend="gloo")  # initialises the default process group
    rows = []
    for name, (model, shape) in models().items():
        bsp, ddp, params = measure(model, shape, args, comm)
        rows.append(f"| {name} | {params:,} | {args.batch} | {bsp:,.0f} | {ddp:,.0f} | {bsp / ddp:.2f} |")
    gloo.close()
    if world.rank == 0:
        head = f"{world.size} ranks, {args.rounds} alternating rounds of {args.steps} steps (median)"
        table = "\n".join(
            [
                head + "; samples/s summed over ranks",
                "",
                "| model | parameters | batch/rank | BSP (mpi4py) samples/s | DDP (Gloo) samples/s "
                "| BSP ÷ DDP |",
                "|---|---:|---:|---:|---:|---:|",
                *rows,
            ]
        )
        print(table)
        if not args.no_write:
            print("appended to", append_result("ddp", "BSP vs DistributedDataParallel (Gloo)", table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
