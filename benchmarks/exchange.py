"""Allreduce of one flat float32 buffer, 1 KB to 400 MB: the framework's shared-memory communicator and its
plain MPICommunicator against raw mpi4py ``Allreduce``, torch.distributed Gloo and one memcpy of the same
bytes, side by side in one run.

    python -m benchmarks.exchange [--ranks 2,4] [--sizes 1K,16K,256K,4M,16M,100M,400M]
    mpiexec -n 2 python -m benchmarks.exchange [...]    # one world size, the one mpiexec started

Without an MPI launcher the script re-launches itself under this environment's mpiexec once per ``--ranks``
entry, then writes one section (command, versions, machine, one table per world size) to
benchmarks/results/exchange.md and a bandwidth-against-size plot to benchmarks/results/exchange-<mpi>.png.

Every method works on the same numpy-allocated buffer (as a learner's flat buffer is), reset before each
sample. Per size, after a warm-up round, every round runs each method once, in an order rotated round by
round, so machine noise hits all methods alike; large sizes get fewer rounds. A sample is the slowest rank's
time for one call (for small sizes, the mean over a batch of calls), between barriers. Reported: median time,
algorithm bandwidth (bytes / median time) and the median's ratio to memcpy's and to raw mpi4py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS, append_result, relaunch, under_mpi

SHM = "framework, shared memory (SharedMemoryCommunicator)"
ZERO = "framework, shared memory, buffer in the window (shared_buffer: no copy in or out)"
PLAIN = "framework, plain MPICommunicator"
RAW = "raw mpi4py Allreduce"
GLOO = "torch.distributed gloo all_reduce"
MEMCPY = "memcpy of the same bytes (1 thread)"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
#: Untimed rounds per size before the timed ones.
WARMUP = 3


def parse_size(text: str) -> int:
    """``16K`` → 16384 bytes (K, M, G are powers of 1024)."""
    text = text.strip().upper()
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def label(size: int) -> str:
    """16384 → ``16K``."""
    for unit in ("G", "M", "K"):
        if size >= UNITS[unit] and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]}{unit}"
    return str(size)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1K,16K,256K,4M,16M,100M,400M", help="buffer sizes in bytes")
    parser.add_argument("--ranks", default="2,4", help="world sizes to re-launch with (without mpiexec)")
    parser.add_argument("--repeats", type=int, default=40, help="timed rounds for small sizes")
    parser.add_argument("--min-repeats", type=int, default=7, help="timed rounds at least, for large sizes")
    parser.add_argument(
        "--shm-variants",
        default="",
        help="extra shared-memory rows, e.g. 1:flags,16:barrier (chunk MB : sync; no minimum size)",
    )
    parser.add_argument("--json", help="(internal) where a launched world writes its samples")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write to results/")
    return parser.parse_args()


def rounds_for(size: int, args: argparse.Namespace) -> int:
    """Fewer rounds for large buffers: about 2 GB moved per method, within [min_repeats, repeats]."""
    return max(args.min_repeats, min(args.repeats, int(2e9 // size)))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every method at every size in this MPI world; rank 0 returns the samples (others: {})."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpicrossbow.comm.mpi import MPICommunicator
    from mpicrossbow.comm.shm import SharedMemoryCommunicator
    from mpicrossbow.comm.torchdist import TorchDistCommunicator
    from mpicrossbow.pool.flat import empty_flat

    world = MPI.COMM_WORLD
    shm, plain = SharedMemoryCommunicator(world), MPICommunicator(world)
    variants: dict[str, SharedMemoryCommunicator] = {}
    for spec in filter(None, args.shm_variants.split(",")):
        mb, sync = spec.split(":")
        variants[f"shared memory, {mb} MB chunks, sync {sync}"] = SharedMemoryCommunicator(
            world,
            window_bytes=int(float(mb) * 2**20),
            min_bytes=0,
            sync=sync,  # type: ignore[arg-type]
        )
    gloo = TorchDistCommunicator.from_mpi(world, backend="gloo")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cpu = torch.device("cpu")
    out: dict[str, Any] = {"ranks": world.Get_size(), "sizes": sizes, "samples": {}, "rounds": {}}
    out["mpi"] = MPI.get_vendor()[0]

    def run_size(size: int) -> dict[str, list[float]]:
        numel = size // 4
        buf, dst = empty_flat(numel, cpu, torch.float32), empty_flat(numel, cpu, torch.float32)
        array = buf.numpy()
        zero_copy = SharedMemoryCommunicator(world)
        window_buf = zero_copy.shared_buffer(numel)
        methods: dict[str, Callable[[], object]] = {
            SHM: lambda: shm.allreduce(buf),
            ZERO: lambda: zero_copy.allreduce(window_buf),
            PLAIN: lambda: plain.allreduce(buf),
            RAW: lambda: world.Allreduce(MPI.IN_PLACE, array, MPI.SUM),
            GLOO: lambda: dist.all_reduce(buf),
            MEMCPY: lambda: dst.copy_(buf),
        }
        for name, comm in variants.items():
            methods[name] = lambda comm=comm: comm.allreduce(buf)  # type: ignore[misc]
        for name, call in methods.items():  # each method sums correctly (memcpy: copies)
            buf.fill_(1)
            window_buf.fill_(1)
            call()
            want = 1.0 if name == MEMCPY else float(world.Get_size())
            got = {MEMCPY: dst, ZERO: window_buf}.get(name, buf)[[0, -1]].tolist()
            assert got == [want, want], f"{name} at {size} B gave {got}, want {want}"
        calls = max(1, min(100, int(1e6 // size)))  # batch tiny calls so one sample is not all timer noise
        names = list(methods)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(WARMUP + rounds_for(size, args)):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                buf.zero_()
                window_buf.zero_()
                world.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    methods[name]()
                elapsed = world.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)
                if round_ >= WARMUP:
                    samples[name].append(elapsed)
        zero_copy.close()
        return samples

    for size in sizes:
        out["samples"][str(size)] = run_size(size)
        out["rounds"][str(size)] = rounds_for(size, args)
    for comm in [shm, plain, *variants.values(), gloo]:
        comm.close()
    return out if world.Get_rank() == 0 else {}


def table(result: dict[str, Any]) -> str:
    """One markdown table per world size: a row per (size, method)."""
    rows = [
        f"### {result['ranks']} ranks",
        "",
        "| size | method | median ms | algbw GB/s | ÷ memcpy | ÷ raw mpi4py | rounds |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for size in result["sizes"]:
        samples = result["samples"][str(size)]
        median = {n: statistics.median(s) for n, s in samples.items()}
        for name, m in median.items():
            rows.append(
                f"| {label(size)} | {name} | {1e3 * m:.3f} | {size / m / 1e9:.2f} | {m / median[MEMCPY]:.2f} "
                f"| {m / median[RAW]:.3f} | {result['rounds'][str(size)]} |"
            )
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: Path, mpi: str) -> None:
    """Algorithm bandwidth against size, one panel per world size, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        sizes = result["sizes"]
        for name in result["samples"][str(sizes[0])]:
            bw = [size / statistics.median(result["samples"][str(size)][name]) / 1e9 for size in sizes]
            ax.plot(sizes, bw, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [label(s) for s in sizes])
        ax.set_xlabel("buffer size (bytes)")
        ax.set_ylabel("algorithm bandwidth (GB/s, bytes / time)")
        ax.set_title(f"allreduce, {result['ranks']} ranks, {mpi}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(results: list[dict[str, Any]]) -> str:
    """The acceptance line: 2 ranks, 100 MB, shared memory ÷ raw mpi4py."""
    lines = []
    for result in results:
        key = str(100 << 20)
        if key in result["samples"]:
            s = result["samples"][key]
            shm, raw = statistics.median(s[SHM]), statistics.median(s[RAW])
            lines.append(
                f"- {result['ranks']} ranks, 100 MB: shared memory ÷ raw mpi4py Allreduce = {shm / raw:.3f} "
                f"(median), {min(s[SHM]) / min(s[RAW]):.3f} (min); plain MPICommunicator ÷ raw = "
                f"{statistics.median(s[PLAIN]) / raw:.3f}; buffer in the window ÷ raw = "
                f"{statistics.median(s[ZERO]) / raw:.3f}"
            )
    return "\n".join(lines)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Print the tables; unless --no-write, append them to exchange.md and write the plot."""
    mpi = results[0]["mpi"]
    vendor = mpi.lower().replace(" ", "")
    text = "\n\n".join([*(table(r) for r in results), summary(results)])
    print(text, flush=True)
    if args.no_write:
        return
    png = RESULTS / f"exchange-{vendor}.png"
    sizes = ", ".join(label(size) for size in results[0]["sizes"])
    if len(results[0]["sizes"]) > 1:  # one size makes no curve: keep the last full run's plot
        plot(results, png, mpi)
    path = append_result(
        "exchange",
        f"Allreduce of {sizes} B, {', '.join(str(r['ranks']) for r in results)} ranks",
        text,
        f"Plot: ![bandwidth against size]({png.name})" if len(results[0]["sizes"]) > 1 else "",
    )
    print("appended to", path)


def main() -> int:
    args = parse_args()
    if under_mpi():
        result = measure(args)
        if result and args.json:
            Path(args.json).write_text(json.dumps(result), encoding="utf-8")
        elif result:
            report([result], args)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (int(r) for r in args.ranks.split(",")):
            path = os.path.join(tmp, f"{ranks}.json")
            code = relaunch(__spec__.name, ranks, [*sys.argv[1:], "--json", path])
            if code != 0:
                return code
            results.append(json.loads(Path(path).read_text(encoding="utf-8")))
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
