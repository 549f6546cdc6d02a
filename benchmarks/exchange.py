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
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "exchange.md"
#: Variables an MPI launcher sets in its ranks; without any of them this is a plain process.
LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
RAW = "raw mpi4py Allreduce, numpy array"
RAW_TORCH = "raw mpi4py Allreduce, torch-allocated memory"
FW_TORCH = "framework MPICommunicator.allreduce, torch tensor"
FW_NUMPY = "framework MPICommunicator.allreduce, numpy-allocated tensor"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=10_000_000, help="float32 elements in the buffer")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--ranks", type=int, default=2, help="ranks when re-launching under mpiexec")
    parser.add_argument("--output", type=Path, default=RESULTS, help="markdown file to append to")
    return parser.parse_args()


def relaunch(args: argparse.Namespace) -> int:
    """Run this script again under the mpiexec next to the interpreter (else on PATH); return its status."""
    here = Path(sys.executable).parent
    launcher = next((str(here / n) for n in ("mpiexec", "mpirun") if (here / n).exists()), None)
    launcher = launcher or shutil.which("mpiexec") or shutil.which("mpirun")
    if launcher is None:
        sys.exit("no mpiexec next to the interpreter or on PATH; run under your MPI launcher")
    command = [launcher, "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    env["MPICROSSBOW_BENCH_COMMAND"] = " ".join(["python", *sys.argv])
    return subprocess.run(command, env=env, timeout=1800).returncode


def machine() -> str:
    """CPU model and core counts, without the hostname."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{model}, {os.cpu_count()} logical cores ({usable} usable), {platform.system()} "
        f"{platform.machine()}; 1-minute load average {load:.1f} at the end of the run (a shared machine)"
    )


def main() -> int:
    args = parse_args()
    if not any(v in os.environ for v in LAUNCHER_VARS):
        return relaunch(args)
    sys.path.insert(0, str(REPO))
    import mpi4py
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpicrossbow.comm.mpi import MPICommunicator
    from mpicrossbow.comm.torchdist import TorchDistCommunicator

    world = MPI.COMM_WORLD
    framework = MPICommunicator(world)
    gloo = TorchDistCommunicator.from_mpi(world, backend="gloo")
    numel = args.numel
    # Buffers per method. numpy asks the kernel for transparent huge pages on large arrays, torch's allocator
    # does not, and that alone moves MPI's time by several percent: so both framework and raw mpi4py are
    # measured on both kinds of memory, and the like-for-like ratios isolate what the framework adds.
    fw_torch, fw_numpy = torch.ones(numel), torch.from_numpy(np.ones(numel, dtype=np.float32))
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

    script = Path(__file__).resolve().relative_to(REPO)
    command = os.environ.get("MPICROSSBOW_BENCH_COMMAND") or " ".join(
        ["mpiexec", "-n", str(world.Get_size()), "python", str(script), *sys.argv[1:]]
    )
    mpi_version = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    record = [
        f"## {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        "",
        f"- command: `{command}`",
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"mpi4py {mpi4py.__version__}, numpy {np.__version__}, "
        f"MPI library: {mpi_version}",
        f"- machine: {machine()}",
        "",
        table,
        "",
        summary,
        "",
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fresh = not args.output.exists()
    with args.output.open("a", encoding="utf-8") as out:
        if fresh:
            out.write("# Exchange benchmark: allreduce of one flat float32 buffer\n\n")
        out.write("\n".join(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
