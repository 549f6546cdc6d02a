"""BSP gradient mode (with and without bucket overlap) against torch DistributedDataParallel (Gloo).

BSP runs through the framework's own code path: a Config, a Session (``prepare_local`` builds the pool from
the engine registry, ``prepare_collective`` the communicator through ``make_communicator`` and binds the
rule) and ``Session.run()`` for a step budget, so whatever communicator the session builds is what is
measured. DDP trains the same model class (same initial weights, same synthetic CIFAR-shaped batches, SGD
with the same momentum) with its default 25 MiB buckets over a Gloo process group bootstrapped from MPI.
Every variant is built fresh for every round, outside the timed region; the rounds rotate the order of the
variants, so machine noise and warm-up hit all alike. Reports samples/s summed over ranks (median over
rounds) and the ratios.

    python -m benchmarks.ddp                         # re-launches itself with mpiexec -n 2
    python -m benchmarks.ddp --ranks 4 --models vgg16 --rounds 3
    python -m benchmarks.ddp --bucket-mb 1,5,25      # one BSP column per bucket size, plus 0 (no overlap)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.report import append_result, relaunch, under_mpi
from data.synthetic import Synthetic
from models.lenet import LeNet
from models.resnet import ResNet
from models.vgg import VGG
from mpicrossbow.model.shard import Shard

#: Validation samples of the benchmark models: Session.run() validates once at the end; keep it negligible.
N_VAL = 16


class BenchLeNet(LeNet):
    """LeNet-5 on synthetic CIFAR-shaped data (3×32×32, 10 classes)."""

    def __init__(self) -> None:
        super().__init__(dataset="mnist", channels=3, image_size=32)

    def data(self, shard: Shard) -> Synthetic:
        """Synthetic CIFAR-shaped samples, a tiny validation set."""
        return Synthetic(shard, (3, 32, 32), 10, n_train=1024, n_val=N_VAL, seed=shard.seed)


class BenchResNet20(ResNet):
    """ResNet-20 (CIFAR, 0.27M parameters) on synthetic CIFAR-shaped data."""

    def __init__(self) -> None:
        super().__init__(depth=20)

    def data(self, shard: Shard) -> Synthetic:
        """Synthetic CIFAR-shaped samples, a tiny validation set."""
        return Synthetic(shard, (3, 32, 32), 10, n_train=1024, n_val=N_VAL, seed=shard.seed)


class BenchVGG16(VGG):
    """VGG-16 with BatchNorm at CIFAR width (14.7M parameters) on synthetic CIFAR-shaped data."""

    def data(self, shard: Shard) -> Synthetic:
        """Synthetic CIFAR-shaped samples, a tiny validation set."""
        return Synthetic(shard, (3, 32, 32), 10, n_train=1024, n_val=N_VAL, seed=shard.seed)


#: --models name → (model class in this file, batch per rank, steps per round).
MODELS = {
    "lenet": (BenchLeNet, 32, 30),
    "resnet20": (BenchResNet20, 32, 12),
    "vgg16": (BenchVGG16, 16, 6),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks when re-launching under mpiexec")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per variant (plus one warm-up)")
    parser.add_argument("--models", default="lenet,resnet20,vgg16", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument(
        "--bucket-mb", default="", help="comma list of BSP bucket sizes in MiB (default: BSP's default)"
    )
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every model's steps/round")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    return parser.parse_args(argv)


def bsp_round(
    world: Any, name: str, bucket_mb: float, steps: int, batch: int, out: str, shared_memory: str = "auto"
) -> tuple[float, float]:
    """Build a BSP session for ``name`` (untimed), then time ``Session.run()`` for ``steps`` steps: (seconds,
    the seconds the session spent in the rule's hooks, i.e. waiting for gradients after backward)."""
    from mpicrossbow.config import load_config
    from mpicrossbow.training.session import Session

    top = {
        "rule": "BSP",
        "modelfile": "benchmarks.ddp",
        "modelclass": MODELS[name][0].__name__,
        "devices": "cpu",
    }
    extra = {
        "__top__": top,
        "session": {
            "steps": steps,
            "seed": 0,
            "output": out,
            "progress": "off",
            "validate_every": 0,
            "log_level": "warning",
        },
        "optim": {"lr": 0.01, "momentum": 0.9},
        "data": {"batch_size": batch},
        "rule": {"mode": "grad", "bucket_mb": bucket_mb},
        "comm": {"shared_memory": shared_memory},
    }
    config = load_config(extra=extra)
    session = Session(config, world)
    session.prepare_local()
    session.prepare_collective()
    world.mpi.Barrier()
    t0 = time.perf_counter()
    result = session.run()
    world.mpi.Barrier()
    seconds = time.perf_counter() - t0
    session.close()
    return seconds, result.exchange_seconds


def ddp_round(world: Any, name: str, steps: int, batch: int, exchange: bool = True) -> float:
    """Build DDP over the default (Gloo) process group (untimed), then time ``steps`` training steps.

    ``exchange=False`` times the same loop on the bare module, no DDP and no exchange at all: every rank
    trains alone. That is the compute floor of these ranks on this machine, so its ratio to DDP is the most
    any exchange engine (with the same forward, backward and optimizer) could reach."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = MODELS[name][0]()
    torch.manual_seed(0)
    module = DistributedDataParallel(model.module()) if exchange else model.module()
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    data = model.data(Shard(world.rank, world.size, batch, 0))
    batches = []
    while len(batches) < steps:
        batches += list(data.train_batches(len(batches)))
    batches = batches[:steps]
    module.train()
    world.mpi.Barrier()
    t0 = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=False)
        model.loss(module(x), y).backward()
        opt.step()
    world.mpi.Barrier()
    return time.perf_counter() - t0


def measure(
    world: Any, name: str, buckets: list[float], args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, float]]:
    """Samples/s over all ranks (median of the timed rounds) of every variant — ``bsp:<MiB>`` (the session's
    communicator: shared memory where ranks share a node), ``mpi:<MiB>`` (the first bucket size with
    ``shared_memory = off``: plain MPI), ``ddp`` and ``alone`` (no exchange: the upper bound) — and each BSP
    variant's median share of its run spent waiting in the rule after backward (rank 0's)."""
    _, batch, steps = MODELS[name]
    steps = max(2, round(steps * args.steps_scale))
    variants = [f"bsp:{mb:g}" for mb in buckets] + [f"mpi:{buckets[0]:g}", "ddp", "alone"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    waits: dict[str, list[float]] = {v: [] for v in variants if v not in ("ddp", "alone")}
    with tempfile.TemporaryDirectory() as tmp:
        out = world.mpi.bcast(tmp, root=0)  # one run folder tree, made by rank 0
        for r in range(args.rounds + 1):  # round 0 warms up
            shift = r % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                if variant in ("ddp", "alone"):
                    seconds = ddp_round(world, name, steps, batch, exchange=variant == "ddp")
                else:
                    memory = "off" if variant.startswith("mpi:") else "auto"
                    seconds, waited = bsp_round(world, name, float(variant[4:]), steps, batch, out, memory)
                    if r:
                        waits[variant].append(waited / seconds)
                if r:
                    times[variant].append(seconds)
    samples = steps * batch * world.size
    rates = {v: samples / statistics.median(t) for v, t in times.items()}
    return rates, {v: statistics.median(w) for v, w in waits.items()}


def main() -> int:
    args = parse_args(sys.argv[1:])
    if not under_mpi():
        return relaunch(__spec__.name, args.ranks, sys.argv[1:])
    from mpicrossbow.launch.world import detect_world
    from mpicrossbow.log import setup_logging

    world = detect_world()  # MPI initialised as the launcher does it
    setup_logging(world.rank, world.size, logging.WARNING)
    import torch

    from mpicrossbow.comm.torchdist import TorchDistCommunicator
    from mpicrossbow.rules import BSP

    default_mb = BSP.Config().bucket_mb
    buckets = [float(b) for b in args.bucket_mb.split(",") if b.strip()] or [default_mb]
    buckets = [*buckets, 0.0] if 0.0 not in buckets else buckets
    torch.set_num_threads(1)  # what the session gives each of 2+ ranks on 2 cores; DDP gets the same
    gloo = TorchDistCommunicator.from_mpi(world.mpi, backend="gloo")  # the default process group for DDP
    rows = []
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        rate, wait = measure(world, name, buckets, args)
        params = sum(p.numel() for p in MODELS[name][0]().module().parameters())
        plain = f"mpi:{buckets[0]:g}"
        cells = [f"{rate[f'bsp:{mb:g}']:,.0f}" for mb in buckets]
        cells += [f"{rate[plain]:,.0f}", f"{rate['ddp']:,.0f}", f"{rate['alone']:,.0f}"]
        ratios = [f"{rate[f'bsp:{mb:g}'] / rate['ddp']:.2f}" for mb in buckets] + [
            f"{rate[plain] / rate['ddp']:.2f}",
            f"{rate['alone'] / rate['ddp']:.2f}",
        ]
        on_off = [f"{rate[f'bsp:{mb:g}'] / rate['bsp:0']:.2f}" for mb in buckets if mb]
        waited = [f"{wait[f'bsp:{mb:g}']:.0%}" for mb in buckets]
        cells = cells + ratios + on_off + waited
        rows.append(f"| {name} | {params:,} | {MODELS[name][1]} | " + " | ".join(cells) + " |")
        if world.rank == 0:
            print(rows[-1], flush=True)
    gloo.close()
    if world.rank == 0:
        label = [f"bucket_mb {mb:g}" if mb else "no overlap" for mb in buckets]
        head = (
            f"{world.size} ranks, {args.rounds} rotating rounds (median), 1 thread per rank; samples/s "
            "summed over ranks; BSP through Session.run() with [rule] bucket_mb as named (0: one allreduce "
            "after backward) over the session's communicator ([comm] shared_memory = auto: the node-shared "
            "window here), and once more with shared_memory = off (plain MPI); DDP with 25 MiB buckets; "
            "'no exchange' is the same loop as DDP's on the bare module, each rank alone (the compute floor),"
            " so 'no exchange ÷ DDP' is the most any exchange engine could reach here"
        )
        table = "\n".join(
            [
                head,
                "",
                "| model | parameters | batch/rank | "
                + " | ".join(f"BSP {lb}" for lb in label)
                + f" | BSP {label[0]}, plain MPI | DDP (Gloo) | no exchange | "
                + " | ".join(f"BSP {lb} ÷ DDP" for lb in label)
                + f" | BSP {label[0]}, plain MPI ÷ DDP | no exchange ÷ DDP"
                + "".join(f" | {lb} ÷ no overlap" for lb, mb in zip(label, buckets, strict=True) if mb)
                + "".join(f" | wait after backward, {lb}" for lb in label)
                + " |",
                "|---|" + "---:|" * (2 + 3 * len(buckets) + 5 + sum(1 for mb in buckets if mb)),
                *rows,
            ]
        )
        print(table)
        if not args.no_write:
            title = "BSP (bucketed overlap and one allreduce) vs DistributedDataParallel (Gloo)"
            print("appended to", append_result("ddp", title, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
