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
    python -m benchmarks.ddp --device cuda --out gpu  # one GPU per rank: BSP over NCCL and MPI vs DDP-NCCL

``--device cuda`` gives rank r the GPU ``cuda<r>`` (one node): BSP's session takes ``DEVICES=cuda0,cuda1,…``
and ``[comm] backend = auto`` (NCCL), its plain-MPI column ``backend = mpi`` (CUDA-aware where the MPI is,
else staged through pinned host memory), and DDP runs over an NCCL default group. NCCL needs a GPU of its own
per rank: with fewer GPUs than ranks the script writes "skipped" with the reason and exits 0.
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
    """Command-line options."""
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank")
    parser.add_argument("--out", default="ddp", help="results/<OUT>.md to append to (gpu.sh: gpu)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    return parser.parse_args(argv)


def gpu_shortfall(device: str, ranks: int, gpus: int) -> str | None:
    """Why ``--device cuda`` cannot run at ``ranks`` ranks with ``gpus`` GPUs (NCCL wants one GPU per rank,
    and BSP against DDP means at least 2 ranks); None when it can, and always on the CPU."""
    if device != "cuda":
        return None
    if gpus == 0:
        return "needs CUDA, and this machine has no CUDA device: skipped"
    need = max(2, ranks)
    if gpus < need:
        return f"needs ≥ {need} GPUs (NCCL: one GPU per rank), this machine has {gpus}: skipped"
    return None


def write_skip(reason: str, args: argparse.Namespace) -> None:
    """Print the reason and (unless --no-write) append it to results/<out>.md as the section's only text."""
    from benchmarks.report import gpu_versions, versions

    print(f"BSP vs DDP-NCCL {reason}", flush=True)
    if not args.no_write:
        title = "BSP vs DistributedDataParallel (NCCL), one GPU per rank"
        text = f"BSP vs DDP-NCCL at {args.ranks} ranks {reason}."
        print(
            "appended to",
            append_result(args.out, title, text, versions_line=f"{versions()}; {gpu_versions()}"),
        )


def bsp_round(
    world: Any,
    name: str,
    bucket_mb: float,
    steps: int,
    batch: int,
    out: str,
    shared_memory: str = "auto",
    device: str = "cpu",
) -> tuple[float, float]:
    """Build a BSP session for ``name`` (untimed), then run ``Session.run()`` for ``steps`` steps: (the
    slowest rank's seconds in the training loop, ``RunResult.train_seconds``; the seconds the session spent
    in the rule's hooks, i.e. waiting for gradients after backward).

    The loop's time leaves out what the DDP and floor timings leave out too — building the model, the run
    folder and the batches — and what they do not do at all: the final validation and writing metrics.h5.

    On ``device = cuda`` rank r trains on ``cuda<r>``; ``shared_memory = off`` then means ``backend = mpi``
    (CUDA-aware or staged), else the session's default on CUDA, NCCL."""
    from mpi4py import MPI

    from mpicrossbow.config import load_config
    from mpicrossbow.training.run.session import Session

    top = {
        "rule": "BSP",
        "modelfile": "benchmarks.ddp",
        "modelclass": MODELS[name][0].__name__,
        "devices": "cpu" if device == "cpu" else ",".join(f"cuda{r}" for r in range(world.size)),
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
        "comm": {"shared_memory": shared_memory}
        if device == "cpu"
        else {"backend": "mpi" if shared_memory == "off" else "auto"},
    }
    config = load_config(extra=extra)
    session = Session(config, world)
    session.prepare_local()
    session.prepare_collective()
    world.mpi.Barrier()
    result = session.run()
    synchronize(device)
    seconds = world.mpi.allreduce(result.train_seconds, op=MPI.MAX)
    session.close()
    return seconds, result.exchange_seconds


def synchronize(device: str) -> None:
    """Wait for this rank's GPU (an MPI barrier does not), so a timed region ends when its kernels do."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def ddp_round(
    world: Any, name: str, steps: int, batch: int, exchange: bool = True, device: str = "cpu"
) -> float:
    """Build DDP over the default (Gloo; NCCL on CUDA) process group (untimed), then time ``steps`` steps.

    ``exchange=False`` times the same loop on the bare module, no DDP and no exchange at all: every rank
    trains alone. That is the compute floor of these ranks on this machine, so its ratio to DDP is the most
    any exchange engine (with the same forward, backward and optimizer) could reach."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = MODELS[name][0]()
    torch.manual_seed(0)
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    bare = model.module().to(where)
    ids = [where] if device == "cuda" else None
    module = DistributedDataParallel(bare, device_ids=ids) if exchange else bare
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    data = model.data(Shard(world.rank, world.size, batch, 0))
    batches = []
    while len(batches) < steps:
        batches += list(data.train_batches(len(batches)))
    batches = batches[:steps]
    module.train()
    synchronize(device)
    world.mpi.Barrier()
    t0 = time.perf_counter()
    for x, y in batches:
        x, y = x.to(where, non_blocking=True), y.to(where, non_blocking=True)
        opt.zero_grad(set_to_none=False)
        model.loss(module(x), y).backward()
        opt.step()
    synchronize(device)
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
                    seconds = ddp_round(world, name, steps, batch, variant == "ddp", args.device)
                else:
                    memory = "off" if variant.startswith("mpi:") else "auto"
                    seconds, waited = bsp_round(
                        world, name, float(variant[4:]), steps, batch, out, memory, args.device
                    )
                    if r:
                        waits[variant].append(waited / seconds)
                if r:
                    times[variant].append(seconds)
    samples = steps * batch * world.size
    rates = {v: samples / statistics.median(t) for v, t in times.items()}
    return rates, {v: statistics.median(w) for v, w in waits.items()}


def main() -> int:
    """Re-launch under mpiexec (or, on CUDA without a GPU per rank, write why not), measure every model,
    and on rank 0 print the table and append it to results/<out>.md."""
    args = parse_args(sys.argv[1:])
    if not under_mpi():
        if args.device == "cuda":
            import torch

            reason = gpu_shortfall(args.device, args.ranks, torch.cuda.device_count())
            if reason:
                write_skip(reason, args)
                return 0
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
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(world.local_rank)  # one GPU per rank (one node: cuda<rank>, as DEVICES says)
    group = TorchDistCommunicator.from_mpi(world.mpi, backend=backend)  # the default process group for DDP
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
        ratios += [f"{rate[f'bsp:{mb:g}'] / rate['alone']:.2f}" for mb in buckets]
        ratios.append(f"{rate[plain] / rate['alone']:.2f}")
        on_off = [f"{rate[f'bsp:{mb:g}'] / rate['bsp:0']:.2f}" for mb in buckets if mb]
        waited = [f"{wait[f'bsp:{mb:g}']:.0%}" for mb in buckets]
        cells = cells + ratios + on_off + waited
        rows.append(f"| {name} | {params:,} | {MODELS[name][1]} | " + " | ".join(cells) + " |")
        if world.rank == 0:
            print(rows[-1], flush=True)
    group.close()
    if world.rank == 0:
        report(world.size, buckets, rows, args)
    return 0


def report(ranks: int, buckets: list[float], rows: list[str], args: argparse.Namespace) -> None:
    """Print the table under its header and (unless --no-write) append it to results/<out>.md."""
    from benchmarks.report import gpu_versions, versions

    cuda = args.device == "cuda"
    ddp, plain = ("DDP (NCCL)", "MPI, CUDA-aware or staged") if cuda else ("DDP (Gloo)", "plain MPI")
    label = [f"bucket_mb {mb:g}" if mb else "no overlap" for mb in buckets]
    where = (
        "(NCCL, one GPU per rank), and once more with [comm] backend = mpi (CUDA-aware where the MPI is, "
        "else staged through pinned host memory)"
        if cuda
        else "([comm] shared_memory = auto: the node-shared window here), and once more with shared_memory = "
        "off (plain MPI)"
    )
    head = (
        f"{ranks} ranks, {args.rounds} rotating rounds (median), 1 thread per rank; samples/s "
        "summed over ranks; BSP through Session.run() with [rule] bucket_mb as named (0: one allreduce "
        f"after backward) over the session's communicator {where}, timed by its training loop "
        "(RunResult.train_seconds of the slowest rank: set-up, the final validation and metrics.h5 left "
        f"out, as the other loops leave out building their model and batches); {ddp} with 25 MiB buckets; "
        "'no exchange' is the same loop as DDP's on the bare module, each rank alone (the compute floor),"
        " so 'no exchange ÷ DDP' is the most any exchange engine could reach here"
    )
    table = "\n".join(
        [
            head,
            "",
            "| model | parameters | batch/rank | "
            + " | ".join(f"BSP {lb}" for lb in label)
            + f" | BSP {label[0]}, {plain} | {ddp} | no exchange | "
            + " | ".join(f"BSP {lb} ÷ DDP" for lb in label)
            + f" | BSP {label[0]}, {plain} ÷ DDP | no exchange ÷ DDP"
            + "".join(f" | BSP {lb} ÷ no exchange" for lb in label)
            + f" | BSP {label[0]}, {plain} ÷ no exchange"
            + "".join(f" | {lb} ÷ no overlap" for lb, mb in zip(label, buckets, strict=True) if mb)
            + "".join(f" | wait after backward, {lb}" for lb in label)
            + " |",
            "|---|" + "---:|" * (2 + 4 * len(buckets) + 6 + sum(1 for mb in buckets if mb)),
            *rows,
        ]
    )
    print(table)
    if not args.no_write:
        title = f"BSP (bucketed overlap and one allreduce) vs DistributedDataParallel ({ddp[5:-1]})"
        line = f"{versions()}; {gpu_versions()}" if cuda else None
        print("appended to", append_result(args.out, title, table, versions_line=line))


if __name__ == "__main__":
    sys.exit(main())
