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

``--device cuda`` allreduces a CUDA buffer instead (rank r on GPU ``r mod GPUs``, every call followed by a
CUDA synchronisation inside the timed region): the framework's MPICommunicator on an MPI without CUDA support,
its pipelined staging (mpicrossbow/comm/staged_pipeline.py: chunks copied out and back on copy streams while
the host sums the chunk between them; buffers of one chunk or less are staged whole), the same with the
chunks summed through node-shared memory (SharedMemoryCommunicator; skipped where /dev/shm is too small), the
whole-buffer staging it replaces (one copy out, MPI, one copy back), device pointers handed to a CUDA-aware
MPI (only where the MPI says it is one), NCCL (only with one GPU per rank: NCCL refuses two ranks on one
GPU), the **floor** — each rank's own pinned device-to-host plus host-to-device copy of the same bytes, what
any staging must at least pay — the host sum alone (the staging communicator's allreduce of a pinned host
tensor of the same bytes: what staging adds to the copies, whatever of it the pipeline overlaps) and one
device-to-device copy. Ratios are to the floor (pipelined staging ÷
floor is the goal figure: at most 1.5 at 16 MB and 100 MB) and to the whole-buffer staging (the gain).
``--stage-chunks 1,16`` adds pipelined rows with other chunk sizes (MB). Whatever cannot run is listed with
its reason under the table.

    python -m benchmarks.exchange --device cuda --ranks 2 --sizes 16K,1M,16M,100M --out gpu
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

from benchmarks.report import RESULTS, append_result, gpu_versions, relaunch, under_mpi, versions

SHM = "framework, shared memory (SharedMemoryCommunicator)"
ZERO = "framework, shared memory, buffer in the window (shared_buffer: no copy in or out)"
DEFAULT = "framework default: a pool's flat buffer after share() (no copy in or out)"
PLAIN = "framework, plain MPICommunicator"
RAW = "raw mpi4py Allreduce"
GLOO = "torch.distributed gloo all_reduce"
MEMCPY = "memcpy of the same bytes (1 thread)"
STAGED = "framework MPICommunicator, pipelined staging through pinned host memory (MPI sums the chunks)"
STAGED_SHM = "framework SharedMemoryCommunicator, pipelined staging (node-shared memory sums the chunks)"
WHOLE = (
    "framework MPICommunicator, whole-buffer staging (one copy out, MPI, one copy back: before the pipeline)"
)
FLOOR = "floor: pinned device-to-host + host-to-device copy of the same bytes (each rank's own two copies)"
HOST_SUM = "host sum alone: MPICommunicator's allreduce of the same bytes in pinned host memory (no device)"
AWARE = "framework MPICommunicator, CUDA-aware MPI (device pointers)"
NCCL = "torch.distributed nccl all_reduce"
D2D = "device-to-device copy of the same bytes"
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the buffer lives")
    parser.add_argument(
        "--stage-chunks", default="", help="--device cuda: extra pipelined-staging rows, chunk sizes in MB"
    )
    parser.add_argument("--out", default="exchange", help="results/<OUT>.md to append to (gpu.sh: gpu)")
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
        pool_buf = empty_flat(numel, cpu, torch.float32)  # as a pool allocates its flat buffers
        zero_copy.share(pool_buf)  # what a rule's bind does with them
        methods: dict[str, Callable[[], object]] = {
            SHM: lambda: shm.allreduce(buf),
            ZERO: lambda: zero_copy.allreduce(window_buf),
            DEFAULT: lambda: zero_copy.allreduce(pool_buf),
            PLAIN: lambda: plain.allreduce(buf),
            RAW: lambda: world.Allreduce(MPI.IN_PLACE, array, MPI.SUM),
            GLOO: lambda: dist.all_reduce(buf),
            MEMCPY: lambda: dst.copy_(buf),
        }
        for name, comm in variants.items():
            methods[name] = lambda comm=comm: comm.allreduce(buf)  # type: ignore[misc]
        own = {MEMCPY: dst, ZERO: window_buf, DEFAULT: pool_buf}
        buffers = {name: own.get(name, buf) for name in methods}
        samples = time_methods(world, methods, buffers, MEMCPY, size, args)
        zero_copy.close()
        return samples

    for size in sizes:
        out["samples"][str(size)] = run_size(size)
        out["rounds"][str(size)] = rounds_for(size, args)
    for comm in [shm, plain, *variants.values(), gloo]:
        comm.close()
    return out if world.Get_rank() == 0 else {}


def cuda_plan(ranks: int, gpus: int, cuda_aware: bool, vendor: str) -> tuple[list[str], dict[str, str]]:
    """Which CUDA methods can run at ``ranks`` ranks on one node with ``gpus`` GPUs, and why each of the
    others cannot: (methods to time, {method: reason it is skipped})."""
    methods, skipped = [STAGED, D2D], {}
    if cuda_aware:
        methods.insert(1, AWARE)
    else:
        skipped[AWARE] = (
            f"this MPI ({vendor}) does not report CUDA support (MPICROSSBOW_CUDA_AWARE=1 forces it)"
        )
    if gpus >= ranks:
        methods.insert(-1, NCCL)
    else:
        skipped[NCCL] = (
            f"needs one GPU per rank ({ranks} ranks, {gpus} GPU(s)): NCCL refuses two ranks on one GPU"
        )
    return methods, skipped


def cuda_rows(planned: list[str], chunk_rows: list[str], shm_ok: bool) -> list[str]:
    """The table's rows for a CUDA run, in order: the pipelined staging (and ``chunk_rows``, its variants),
    through shared memory where ``shm_ok``, the whole-buffer staging, then :func:`cuda_plan`'s other methods,
    the floor and the host sum alone before the device copy."""
    rest = [name for name in planned if name not in (STAGED, D2D)]
    return [STAGED, *chunk_rows, *([STAGED_SHM] if shm_ok else []), WHOLE, *rest, FLOOR, HOST_SUM, D2D]


def shm_room(window_bytes: int, ranks: int) -> str:
    """Why a SharedMemoryCommunicator with ``window_bytes`` chunks cannot be made here ('' if it can): its
    window takes (2p + 4) chunks of /dev/shm, and a container's /dev/shm may be 64 MB in all."""
    need = 2 * (2 * ranks + 4) * window_bytes  # twice the window: MPICH's own segments live there too
    try:
        stat = os.statvfs("/dev/shm")
    except OSError as exc:
        return f"no /dev/shm ({exc})"
    free = stat.f_bavail * stat.f_frsize
    return "" if free >= need else f"/dev/shm has {free >> 20} MB free, the window wants {need >> 20} MB"


def with_cuda_aware(flag: str, shared_memory: bool = False, stage_chunk_bytes: int | None = None) -> Any:
    """An MPICommunicator (``shared_memory``: a SharedMemoryCommunicator with windows of one staging chunk)
    over COMM_WORLD built with ``MPICROSSBOW_CUDA_AWARE=flag`` (read at construction: "0" stages through
    pinned host memory, "1" hands device pointers to MPI); the environment is put back. ``stage_chunk_bytes``
    overrides the pipelined staging's chunk (0: whole-buffer staging)."""
    from mpi4py import MPI

    from mpicrossbow.comm.mpi import MPICommunicator
    from mpicrossbow.comm.shm import SharedMemoryCommunicator
    from mpicrossbow.comm.staged_pipeline import stage_chunk_bytes as default_chunk

    before = os.environ.get("MPICROSSBOW_CUDA_AWARE")
    os.environ["MPICROSSBOW_CUDA_AWARE"] = flag
    try:
        if shared_memory:
            return SharedMemoryCommunicator(MPI.COMM_WORLD, window_bytes=default_chunk())
        return MPICommunicator(MPI.COMM_WORLD, stage_chunk_bytes=stage_chunk_bytes)
    finally:
        if before is None:
            del os.environ["MPICROSSBOW_CUDA_AWARE"]
        else:
            os.environ["MPICROSSBOW_CUDA_AWARE"] = before


def cuda_methods(
    comms: dict[str, Any], buf: Any, dst: Any, host: Any, summed: Any
) -> dict[str, Callable[[], object]]:
    """Each communicator's allreduce of ``buf``, the floor (``buf`` → pinned ``host`` → ``dst``, both copies
    queued on the current stream), the host sum alone (the staging communicator's allreduce of the pinned
    host tensor ``summed``: what staging adds to the floor, whatever it overlaps) and the copy ``buf`` →
    ``dst``, each followed by a CUDA synchronisation, so a timed call ends when the GPU's work (NCCL's
    kernel, a staging copy) has."""
    import torch

    def synced(call: Callable[[], object]) -> Callable[[], object]:
        return lambda: (call(), torch.cuda.synchronize())

    methods = {name: synced(lambda c=comm: c.allreduce(buf)) for name, comm in comms.items()}
    methods[FLOOR] = synced(lambda: (host.copy_(buf, non_blocking=True), dst.copy_(host, non_blocking=True)))
    methods[HOST_SUM] = synced(lambda: comms[STAGED].allreduce(summed))
    methods[D2D] = synced(lambda: dst.copy_(buf))
    return methods


def cuda_comms(args: argparse.Namespace, names: list[str], skipped: dict[str, str]) -> dict[str, Any]:
    """The communicators of a CUDA run by row: the pipelined staging (and its ``--stage-chunks`` variants),
    through shared memory where /dev/shm has room (else its reason goes into ``skipped``), the whole-buffer
    staging, CUDA-aware MPI and NCCL where :func:`cuda_plan` put them in ``names``."""
    from mpi4py import MPI

    from mpicrossbow.comm.staged_pipeline import stage_chunk_bytes
    from mpicrossbow.comm.torchdist import TorchDistCommunicator

    world = MPI.COMM_WORLD
    comms: dict[str, Any] = {STAGED: with_cuda_aware("0")}
    for mb in filter(None, args.stage_chunks.split(",")):
        chunk = int(float(mb) * 2**20)
        comms[f"pipelined staging, {mb} MB chunks (MPI sums them)"] = with_cuda_aware(
            "0", stage_chunk_bytes=chunk
        )
    why = world.allreduce(shm_room(stage_chunk_bytes(), world.Get_size()), op=MPI.MAX)  # one answer for all
    if why:  # the window is collective: every rank skips it alike
        skipped[STAGED_SHM] = why
    else:
        comms[STAGED_SHM] = with_cuda_aware("0", shared_memory=True)
    comms[WHOLE] = with_cuda_aware("0", stage_chunk_bytes=0)
    if AWARE in names:
        comms[AWARE] = with_cuda_aware("1")
    if NCCL in names:
        comms[NCCL] = TorchDistCommunicator.from_mpi(world, backend="nccl")
    return comms


def measure_cuda(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`measure` on a CUDA buffer: the pipelined, shared-memory and whole-buffer staging, CUDA-aware MPI
    and NCCL as :func:`cuda_plan` allows, the floor and a device copy; rank 0 returns the samples (others:
    {})."""
    import torch
    from mpi4py import MPI

    from mpicrossbow.comm.mpi import mpi_cuda_aware

    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local.Get_rank() % gpus)
    names, skipped = cuda_plan(local.Get_size(), gpus, mpi_cuda_aware(), MPI.get_vendor()[0])
    local.Free()
    comms = cuda_comms(args, names, skipped)
    rows = cuda_rows(names, [n for n in comms if n.startswith("pipelined staging, ")], STAGED_SHM in comms)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {"ranks": world.Get_size(), "sizes": sizes, "samples": {}, "rounds": {}}
    out |= {"mpi": MPI.get_vendor()[0], "reference": WHOLE, "copy": FLOOR, "skipped": skipped}
    for size in sizes:
        buf = torch.empty(size // 4, device="cuda", dtype=torch.float32)
        dst = torch.empty_like(buf)
        host = torch.empty(size // 4, dtype=torch.float32, pin_memory=True)
        summed = torch.empty(size // 4, dtype=torch.float32, pin_memory=True)
        made = cuda_methods(comms, buf, dst, host, summed)
        methods = {name: made[name] for name in rows}
        buffers = {name: {FLOOR: dst, D2D: dst, HOST_SUM: summed}.get(name, buf) for name in methods}
        out["samples"][str(size)] = time_methods(
            world, methods, buffers, (FLOOR, D2D), size, args, settle=torch.cuda.synchronize
        )
        out["rounds"][str(size)] = rounds_for(size, args)
    for comm in comms.values():
        comm.close()
    return out if world.Get_rank() == 0 else {}


def time_methods(
    world: Any,
    methods: dict[str, Callable[[], object]],
    buffers: dict[str, Any],
    copy: str | tuple[str, ...],
    size: int,
    args: argparse.Namespace,
    settle: Callable[[], object] | None = None,
) -> dict[str, list[float]]:
    """Check that every method sums (``copy``, one name or several: copies) into its buffer in ``buffers``,
    then time them all in rotating rounds, the buffers zeroed before each sample (then ``settle()``: a CUDA
    zeroing must finish before the clock starts): the slowest rank's seconds per call, by name."""
    from mpi4py import MPI

    copies = {copy} if isinstance(copy, str) else set(copy)
    inputs = list({id(b): b for b in buffers.values()}.values())
    for name, call in methods.items():
        for b in inputs:
            b.fill_(1)
        if name in copies:
            buffers[name].zero_()  # the copy's destination: only the copy can make it 1
        call()
        want = 1.0 if name in copies else float(world.Get_size())
        got = buffers[name][[0, -1]].tolist()
        assert got == [want, want], f"{name} at {size} B gave {got}, want {want}"
    calls = max(1, min(100, int(1e6 // size)))  # batch tiny calls so one sample is not all timer noise
    names = list(methods)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(WARMUP + rounds_for(size, args)):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            for b in inputs:
                b.zero_()
            if settle is not None:
                settle()
            world.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                methods[name]()
            elapsed = world.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)
            if round_ >= WARMUP:
                samples[name].append(elapsed)
    return samples


def table(result: dict[str, Any]) -> str:
    """One markdown table per world size: a row per (size, method); then the methods skipped and why."""
    reference, copy = result.get("reference", RAW), result.get("copy", MEMCPY)
    names = {
        RAW: "raw mpi4py",
        STAGED: "staged MPI",
        MEMCPY: "memcpy",
        D2D: "device copy",
        FLOOR: "floor",
        WHOLE: "whole-buffer staging",
    }
    rows = [
        f"### {result['ranks']} ranks",
        "",
        f"| size | method | median ms | algbw GB/s | ÷ {names[copy]} | ÷ {names[reference]} | rounds |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for size in result["sizes"]:
        samples = result["samples"][str(size)]
        median = {n: statistics.median(s) for n, s in samples.items()}
        for name, m in median.items():
            rows.append(
                f"| {label(size)} | {name} | {1e3 * m:.3f} | {size / m / 1e9:.2f} | {m / median[copy]:.2f} "
                f"| {m / median[reference]:.3f} | {result['rounds'][str(size)]} |"
            )
    rows += ["", *(f"- {name}: skipped, {why}" for name, why in result.get("skipped", {}).items())]
    return "\n".join(rows).rstrip()


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


def cuda_summary(result: dict[str, Any]) -> list[str]:
    """The goal lines of a CUDA run: at 16 MB and 100 MB, each staging ÷ the floor (goal: the pipelined
    staging at most 1.5), medians."""
    lines = []
    for size in (16 << 20, 100 << 20):
        s = result["samples"].get(str(size), {})
        if FLOOR not in s:
            continue
        floor = statistics.median(s[FLOOR])
        ratios = ", ".join(
            f"{label_} {statistics.median(s[name]) / floor:.2f}"
            for name, label_ in (
                (STAGED, "pipelined (MPI)"),
                (STAGED_SHM, "pipelined (shared memory)"),
                (WHOLE, "whole-buffer"),
            )
            if name in s
        )
        line = f"- {result['ranks']} ranks, {label(size)}: staging ÷ floor = {ratios} (goal: pipelined ≤ 1.5)"
        if HOST_SUM in s and STAGED in s:  # the sum alone: what no staging avoids, next to the copies
            host_sum = statistics.median(s[HOST_SUM])
            line += (
                f"; the host sum alone ÷ floor {host_sum / floor:.2f}, pipelined ÷ (floor + host sum) "
                f"{statistics.median(s[STAGED]) / (floor + host_sum):.2f}"
            )
        lines.append(line)
    return lines


def summary(results: list[dict[str, Any]]) -> str:
    """The acceptance lines: 100 MB, the default path (a pool's buffer after share()) and the copying
    shared-memory path ÷ raw mpi4py, and the default path ÷ one memcpy; of CUDA runs,
    :func:`cuda_summary`'s."""
    lines = []
    for result in results:
        lines += cuda_summary(result)
        key = str(100 << 20)
        if key in result["samples"] and SHM in result["samples"][key]:
            s = result["samples"][key]
            shm, raw = statistics.median(s[SHM]), statistics.median(s[RAW])
            lines.append(
                f"- {result['ranks']} ranks, 100 MB: shared memory ÷ raw mpi4py Allreduce = {shm / raw:.3f} "
                f"(median), {min(s[SHM]) / min(s[RAW]):.3f} (min); plain MPICommunicator ÷ raw = "
                f"{statistics.median(s[PLAIN]) / raw:.3f}; buffer in the window ÷ raw = "
                f"{statistics.median(s[ZERO]) / raw:.3f}"
            )
            default = statistics.median(s[DEFAULT])
            lines.append(
                f"- {result['ranks']} ranks, 100 MB, the default path (a pool's buffer after share()): "
                f"÷ raw mpi4py Allreduce = {default / raw:.3f}, ÷ one memcpy = "
                f"{default / statistics.median(s[MEMCPY]):.3f} (medians)"
            )
    return "\n".join(lines)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Print the tables; unless --no-write, append them to results/<out>.md and (CPU) write the plot."""
    mpi = results[0]["mpi"]
    cuda = args.device == "cuda"
    vendor = mpi.lower().replace(" ", "")
    text = "\n\n".join([*(table(r) for r in results), summary(results)])
    print(text, flush=True)
    if args.no_write:
        return
    png = RESULTS / f"exchange-{vendor}.png"
    sizes = ", ".join(label(size) for size in results[0]["sizes"])
    drawn = len(results[0]["sizes"]) > 1 and not cuda  # one size makes no curve: keep the last full plot
    if drawn:
        plot(results, png, mpi)
    path = append_result(
        args.out,
        f"Allreduce{' of a CUDA buffer' if cuda else ''} of {sizes} B, "
        f"{', '.join(str(r['ranks']) for r in results)} ranks",
        text,
        f"Plot: ![bandwidth against size]({png.name})" if drawn else "",
        versions_line=f"{versions()}; {gpu_versions()}" if cuda else None,
    )
    print("appended to", path)


def cuda_available() -> bool:
    """torch.cuda.is_available(), asked in the launching process before any rank starts."""
    import torch

    return torch.cuda.is_available()


def main() -> int:
    """Measure in this MPI world, or re-launch under mpiexec once per --ranks entry, then report."""
    args = parse_args()
    if under_mpi():
        result = measure_cuda(args) if args.device == "cuda" else measure(args)
        if result and args.json:
            Path(args.json).write_text(json.dumps(result), encoding="utf-8")
        elif result:
            report([result], args)
        return 0
    if args.device == "cuda" and not cuda_available():
        print("exchange over CUDA: needs a CUDA device, and this machine has none: skipped", flush=True)
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
