"""``[comm] compression``: digits accuracy with fp32, bf16 and fp16 exchange for every rule, and the time of a
100 MB exchange in bf16/fp16 against fp32 at 2 ranks, side by side.

    python -m benchmarks.compression [--seeds 0] [--numel 25000000] [--repeats 10]

Accuracy: every rule's digits job (launch/digits.cfg) at the world size and with the settings of its digits
test (tests/test_compression_mpi.py), once per compression and seed; the table gives the final validation
accuracy and the best one. Exchange time: one ``mpiexec -n 2`` job times, per round and in an order rotated
round by round, the framework's allreduce and a one-way isend/irecv of the same float32 buffer through the
plain MPI communicator and through the bf16 and fp16 wrappers; a sample is the slowest rank's time between
barriers, and the table gives each median over fp32's. Results are appended to
benchmarks/results/compression.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.report import REPO, append_result, relaunch, under_mpi

#: (label, world size, overrides, target) of every rule: the settings of tests/test_compression_mpi.py.
RULES: list[tuple[str, int, list[str], float]] = [
    ("BSP", 2, ["RULE=BSP"], 0.95),
    ("SMA", 2, ["RULE=SMA"], 0.95),
    ("EASGD sync", 2, ["RULE=EASGD"], 0.95),
    ("EASGD async", 4, ["RULE=EASGD", "rule.mode=async"], 0.93),
    ("GOSGD", 4, ["RULE=GOSGD", "rule.p=0.05"], 0.93),
    ("ASGD", 4, ["RULE=ASGD"], 0.93),
    ("SSP", 4, ["RULE=SSP", "rule.staleness=2"], 0.93),
    ("PSGD", 4, ["RULE=PSGD"], 0.93),
    ("WEEDOUT", 4, ["RULE=WEEDOUT"], 0.93),
    (
        "LOCALSGD (hier., 2 learners/rank)",
        4,
        ["RULE=LOCALSGD", "rule.inner_period=2", "pool.learners=2"],
        0.93,
    ),
    ("DILOCO", 4, ["RULE=DILOCO"], 0.93),
]
COMPRESSIONS = ("none", "bf16", "fp16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="session.seed of the digits runs")
    parser.add_argument("--numel", type=int, default=25_000_000, help="float32 elements exchanged (100 MB)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds of the exchange benchmark")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--skip-accuracy", action="store_true", help="only the exchange-time table")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    parser.add_argument("--exchange-json", help=argparse.SUPPRESS)  # the MPI child's output file
    return parser.parse_args()


def digits(ranks: int, overrides: list[str], out: Path) -> dict[str, float] | None:
    """Run one digits job; its final and best validation accuracy (None if it failed)."""
    from mpicrossbow.training.reporting.metrics import read_metrics

    here = Path(sys.executable).parent
    cmd = [str(here / "mpiexec"), "-n", str(ranks), str(here / "crossbow-launch"), "-cfg",
           "launch/digits.cfg", f"session.output={out}", "session.progress=off", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        print(f"  failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    accuracy = read_metrics(run / "metrics.h5")["val"]["accuracy"]
    return {"final": float(accuracy[-1]), "best": float(max(accuracy))}


def accuracy_table(seeds: list[int]) -> str:
    """Final (best) accuracy per rule and compression, every seed; ✓ where the final one meets the target."""
    results: dict[tuple[str, str, int], dict[str, float] | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, ranks, overrides, _ in RULES:
            for seed in seeds:
                for compression in COMPRESSIONS:  # interleaved, so load drifts hit every compression alike
                    out = Path(tmp) / f"{label}-{compression}-{seed}".replace(" ", "_").replace("/", "_")
                    extra = [f"comm.compression={compression}", f"session.seed={seed}"]
                    start = time.monotonic()
                    results[label, compression, seed] = digits(ranks, [*overrides, *extra], out)
                    print(f"{label} {compression} seed {seed}: {results[label, compression, seed]} "
                          f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip

    def cell(label: str, compression: str, target: float) -> str:
        parts = []
        for seed in seeds:
            r = results[label, compression, seed]
            if r is None:
                parts.append("failed")
                continue
            mark = " ✓" if r["final"] >= target else ""
            parts.append(f"{100 * r['final']:.1f} ({100 * r['best']:.1f}){mark}")
        return " / ".join(parts)

    rows = [
        "| rule | ranks | target | fp32 (none) | bf16 | fp16 |",
        "|---|---:|---:|---|---|---|",
        *(
            f"| {label} | {ranks} | {100 * target:.0f} % | "
            + " | ".join(cell(label, c, target) for c in COMPRESSIONS)
            + " |"
            for label, ranks, _, target in RULES
        ),
    ]
    return "\n".join(rows)


def exchange(args: argparse.Namespace) -> int:
    """Under ``mpiexec -n 2``: time allreduce and isend/irecv of ``numel`` float32, fp32 vs bf16 vs fp16."""
    import torch
    from mpi4py import MPI

    from mpicrossbow.comm import CompressedCommunicator
    from mpicrossbow.comm.base import Communicator
    from mpicrossbow.comm.mpi import MPICommunicator

    world = MPI.COMM_WORLD
    plain = MPICommunicator(world)
    comms: dict[str, Communicator] = {
        "fp32": plain,
        "bf16": CompressedCommunicator(plain, torch.bfloat16),
        "fp16": CompressedCommunicator(plain, torch.float16),
    }
    tensor = torch.ones(args.numel)
    rank, peer = world.Get_rank(), 1 - world.Get_rank()

    def allreduce(comm: Communicator) -> Callable[[], None]:
        return lambda: comm.allreduce(tensor).wait()

    def send_recv(comm: Communicator) -> Callable[[], None]:
        def call() -> None:
            handle = comm.isend(tensor, peer) if rank == 0 else comm.irecv(tensor, peer)
            handle.wait()

        return call

    ops = (("allreduce", allreduce), ("isend/irecv", send_recv))
    methods = {f"{op} {name}": make(comm) for op, make in ops for name, comm in comms.items()}
    # The same over the node-shared-memory allreduce ([comm] shared_memory = auto on one node), whose bf16
    # sum is accumulated in float32 inside the window instead of through a float32 copy.
    from mpicrossbow.comm.shm import SharedMemoryCommunicator

    shm = SharedMemoryCommunicator(world)
    for name, comm in (("fp32", shm), ("bf16", CompressedCommunicator(shm, torch.bfloat16))):
        methods[f"shared-memory allreduce {name}"] = allreduce(comm)
    # For reference: raw mpi4py on the same bytes, float32 with MPI.SUM against bf16 words reduced by a
    # user-defined op that adds each pair in float32 and rounds once (torch's bf16 add) -- what a native
    # 16-bit reduction in the MPI backend would cost; the framework's MPI backend reduces 16-bit tensors
    # through a float32 copy instead.
    raw32, raw16 = torch.ones(args.numel), torch.ones(args.numel, dtype=torch.bfloat16)

    def add_bf16(inbuf: object, outbuf: object, datatype: MPI.Datatype) -> None:
        out = torch.frombuffer(outbuf, dtype=torch.bfloat16)
        torch.add(out, torch.frombuffer(inbuf, dtype=torch.bfloat16), out=out)

    sum_bf16 = MPI.Op.Create(add_bf16, commute=True)
    methods["raw Allreduce fp32"] = lambda: world.Allreduce(MPI.IN_PLACE, raw32.numpy(), MPI.SUM)
    methods["raw Allreduce bf16"] = lambda: world.Allreduce(
        MPI.IN_PLACE, [raw16.view(torch.int16).numpy(), MPI.INT16_T], sum_bf16
    )
    names = list(methods)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.warmup + args.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            tensor.fill_(1.0)
            raw32.fill_(1.0)
            raw16.fill_(1.0)
            world.Barrier()
            start = time.perf_counter()
            methods[name]()
            elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if round_ >= args.warmup:
                samples[name].append(elapsed)
    sum_bf16.Free()
    shm.close()
    if rank == 0 and args.exchange_json:
        Path(args.exchange_json).write_text(
            json.dumps({"samples": samples, "threads": torch.get_num_threads()}), encoding="utf-8"
        )
    return 0


def exchange_table(args: argparse.Namespace) -> str:
    """Run :func:`exchange` under ``mpiexec -n 2`` and tabulate medians and ratios to fp32."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "exchange.json"
        argv = ["--exchange-json", str(out), "--numel", str(args.numel), "--repeats", str(args.repeats),
                "--warmup", str(args.warmup)]  # fmt: skip
        if relaunch(__spec__.name, 2, argv) != 0:
            raise SystemExit("the exchange benchmark failed")
        found = json.loads(out.read_text(encoding="utf-8"))
    samples = found["samples"]
    median = {n: statistics.median(s) for n, s in samples.items()}
    rows = ["| operation | wire | median ms | min ms | median ÷ fp32 |", "|---|---|---:|---:|---:|"]
    for name in samples:
        op, wire = name.rsplit(" ", 1)
        base = median[f"{op} fp32"]
        rows.append(f"| {op} | {wire} | {1e3 * median[name]:.1f} | {1e3 * min(samples[name]):.1f} | "
                    f"{median[name] / base:.3f} |")  # fmt: skip
    rows.append("")
    rows.append(
        f"2 ranks, {args.numel:,} float32 ({args.numel * 4 / 1e6:.0f} MB) per exchange, "
        f"{args.repeats} rounds after {args.warmup} warm-up, order rotated every round; "
        f"torch threads {found['threads']}"
    )
    return "\n".join(rows)


def main() -> int:
    args = parse_args()
    if under_mpi():
        return exchange(args)
    sections = []
    if not args.skip_accuracy:
        table = accuracy_table(args.seeds)
        print(table, flush=True)
        sections.append(
            "Final validation accuracy % (best in brackets; ✓: final ≥ the rule's target), "
            f"seed{'s' if len(args.seeds) > 1 else ''} {', '.join(map(str, args.seeds))}:\n\n{table}"
        )
    table = exchange_table(args)
    print(table, flush=True)
    sections.append(f"Exchange time of one 100 MB buffer, bf16/fp16 vs fp32:\n\n{table}")
    if not args.no_write:
        body = "\n\n".join(sections)
        print("appended to", append_result("compression", "fp32 vs bf16 vs fp16 exchange", body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
