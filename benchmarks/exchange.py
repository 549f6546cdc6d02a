"""Allreduce of one flat float32 buffer: the framework's MPICommunicator against raw mpi4py, torch.distributed
Gloo and one memcpy of the same bytes, side by side in one run.

    mpiexec -n 2 python benchmarks/exchange.py [--numel 10000000] [--repeats 20]
    python benchmarks/exchange.py [...]     # re-launches itself under this environment's mpiexec -n 2

After a warm-up, every round runs each method once, in an order rotated round by round, so machine noise
hits all methods alike. A sample is the slowest rank's time for one call, between barriers. Rank 0 prints a
markdown table (median and min per method, and each median over raw mpi4py's) and appends it, with the
date, command, versions and CPU, to benchmarks/results/exchange.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import append_result, relaunch, under_mpi

RAW = "raw mpi4py Allreduce, numpy array"
RAW_TORCH = "raw mpi4py Allreduce, torch-allocated memory"
FW_TORCH = "framework MPICommunicator.allreduce, torch tensor"
FW_NUMPY = "framework MPICommunicator.allreduce, a learner's flat buffer (numpy-allocated)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=10_000_000, help="float32 elements in the buffer")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--ranks", type=int, default=2, help="ranks when re-launching under mpiexec")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not under_mpi():
        return relaunch(__file__, args.ranks, sys.argv[1:])
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpicrossbow.comm.mpi import MPICommunicator
    from mpicrossbow.comm.torchdist import TorchDistCommunicator
    from mpicrossbow.pool.flat import empty_flat

    world = MPI.COMM_WORLD
    framework = MPICommunicator(world)
    gloo = TorchDistCommunicator.from_mpi(world, backend="gloo")
    numel = args.numel
    # Buffers per method. numpy asks the kernel for transparent huge pages on large arrays, torch's allocator
    # does not, and that alone moves MPI's time by several percent: so both framework and raw mpi4py are
    # measured on both kinds of memory, and the like-for-like ratios isolate what the framework adds.
    fw_torch, fw_numpy = torch.ones(numel), empty_flat(numel, torch.device("cpu"), torch.float32).fill_(1)
    raw_numpy, raw_torch = np.ones(numel, dtype=np.float32), torch.ones(numel).numpy()
    gloo_tensor, src, dst = torch.ones(numel), torch.ones(numel), torch.empty(numel)

    def raw(array: np.ndarray) -> Callable[[], None]:
        return lambda: world.Allreduce(MPI.IN_PLACE, array, MPI.SUM)

    methods: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {  # (untimed reset, timed call)
        FW_TORCH: (lambda: fw_torch.fill_(1), lambda: framework.allreduce(fw_torch)),
        FW_NUMPY: (lambda: fw_numpy.fill_(1), lambda: framework.allreduce(fw_numpy)),
        RAW: (lambda: raw_numpy.fill(1), raw(raw_numpy)),
        RAW_TORCH: (lambda: raw_torch.fill(1), raw(raw_torch)),
        "torch.distributed gloo all_reduce": (
            lambda: gloo_tensor.fill_(1),
            lambda: dist.all_reduce(gloo_tensor),
        ),
        "memcpy dst.copy_(src), 1 thread": (lambda: src.fill_(1), lambda: dst.copy_(src)),
    }
    names = list(methods)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.warmup + args.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            reset, call = methods[name]
            reset()
            world.Barrier()
            start = time.perf_counter()
            call()
            elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if round_ >= args.warmup:
                samples[name].append(elapsed)
    assert fw_torch[0].item() == raw_numpy[0] == gloo_tensor[0].item() == world.Get_size()
    gloo.close()
    if world.Get_rank() != 0:
        return 0

    median = {n: statistics.median(s) for n, s in samples.items()}
    lowest = {n: min(s) for n, s in samples.items()}
    rows = [
        "| method | median ms | min ms | median ÷ raw mpi4py on a numpy array |",
        "|---|---:|---:|---:|",
        *(
            f"| {n} | {1e3 * median[n]:.2f} | {1e3 * lowest[n]:.2f} | {median[n] / median[RAW]:.3f} |"
            for n in names
        ),
    ]

    def ratio(a: str, b: str) -> str:
        return f"median {median[a] / median[b]:.3f}, min {lowest[a] / lowest[b]:.3f}"

    summary = "\n".join(
        [
            f"- framework ÷ raw mpi4py, same torch-allocated memory: {ratio(FW_TORCH, RAW_TORCH)}",
            f"- framework ÷ raw mpi4py, same numpy-allocated memory: {ratio(FW_NUMPY, RAW)}",
            f"- framework on a torch tensor ÷ raw mpi4py on a numpy array: {ratio(FW_TORCH, RAW)}",
            f"- {world.Get_size()} ranks, {numel:,} float32 ({numel * 4 / 1e6:.0f} MB), "
            f"{args.repeats} rounds after {args.warmup} warm-up, torch threads {torch.get_num_threads()}",
        ]
    )
    table = "\n".join(rows)
    print(f"{table}\n\n{summary}", flush=True)

    if not args.no_write:
        print(
            "appended to",
            append_result("exchange", "Allreduce of one flat float32 buffer", f"{table}\n\n{summary}"),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
