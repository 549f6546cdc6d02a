"""Soak: long asynchronous runs must not grow memory or leave messages in flight; checkpoint I/O speed.

Part 1 runs ``steps`` training steps (default 20,000 per rank) of GOSGD and of asynchronous EASGD on the
digits job with 4 ranks, and reads from the run's metrics.h5 every rank's resident memory when training
started and when it ended, and the requests still outstanding after ``finish()`` (must be 0). Part 2 times
writing and reading one checkpoint (atomic save + ``weights_only`` load) against model size, in one process.
Writes ``benchmarks/results/soak.md``.

    python -m benchmarks.soak [--steps 20000] [--ranks 4] [--sizes 1 10 50]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import REPO, append_result

#: (label, overrides) of the long runs.
RUNS = [
    ("GOSGD (p = 0.05)", ["RULE=GOSGD", "rule.p=0.05"]),
    ("EASGD async (τ = 10)", ["RULE=EASGD", "rule.mode=async"]),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20_000, help="training steps per rank")
    parser.add_argument("--ranks", type=int, default=4, help="MPI ranks")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 10, 50], help="model sizes, M floats")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/")
    return parser.parse_args()


def soak(ranks: int, steps: int, overrides: list[str], out: Path) -> tuple[dict, float]:
    """One long run; its metrics attributes and wall time."""
    from mpicrossbow.training.reporting.metrics import read_metrics

    here = Path(sys.executable).parent
    cmd = [str(here / "mpiexec"), "-n", str(ranks), str(here / "crossbow-launch"), "-cfg",
           "launch/digits.cfg", f"session.output={out}", "session.progress=off", f"session.steps={steps}",
           "session.epochs=100000", "session.validate_every=0", *overrides]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return read_metrics(run / "metrics.h5")["attrs"], wall


def checkpoint_io(millions: float) -> tuple[float, float]:
    """Median seconds to save and to load a checkpoint of ``millions`` float32 values (3 rounds)."""
    import torch

    from mpicrossbow.training.checkpoints.checkpoint_files import (
        FORMAT_VERSION,
        Checkpointer,
        load_rank_state,
    )

    state = {"rank": 0, "params": torch.randn(int(millions * 1e6))}
    meta = {"world_size": 1}
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        ck = Checkpointer(Path(tmp), 0, 1, keep=1)
        for step in range(3):
            t = time.perf_counter()
            path = ck.save(step, state, meta)
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            _, loaded = load_rank_state(path, 0, meta)
            loads.append(time.perf_counter() - t)
            assert loaded["version"] == FORMAT_VERSION and torch.equal(loaded["params"], state["params"])
    return statistics.median(saves), statistics.median(loads)


def main() -> None:
    args = parse_args()
    rows = [
        "| rule | ranks | steps per rank | wall s | RSS after 1,000 steps, MB (per rank) | RSS at end, MB | "
        "growth | requests in flight at exit |",
        "|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for label, overrides in RUNS:
        with tempfile.TemporaryDirectory() as tmp:
            attrs, wall = soak(args.ranks, args.steps, overrides, Path(tmp))
        start, end = list(attrs["rank_rss_warm_mb"]), list(attrs["rank_rss_end_mb"])
        growth = max((e - s) / s for s, e in zip(start, end, strict=True) if s == s)
        in_flight = int(sum(attrs["rank_in_flight"]))
        fmt = ", ".join
        rows.append(
            f"| {label} | {args.ranks} | {args.steps:,} | {wall:.0f} | {fmt(f'{v:.0f}' for v in start)} | "
            f"{fmt(f'{v:.0f}' for v in end)} | {growth:+.1%} | {in_flight} |"
        )
        print(rows[-1], flush=True)
    io = [
        "| model size (float32) | MB | save s | load s | save MB/s | load MB/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for millions in args.sizes:
        save_s, load_s = checkpoint_io(millions)
        mb = millions * 4
        io.append(
            f"| {millions:g} M | {mb:.0f} | {save_s:.3f} | {load_s:.3f} | {mb / save_s:.0f} | "
            f"{mb / load_s:.0f} |"
        )
        print(io[-1], flush=True)
    table = (
        "\n".join(rows)
        + "\n\nCheckpoint write (temporary file, fsync, rename) and read (`weights_only`):\n\n"
    )
    table += "\n".join(io)
    notes = (
        "Growth is the largest per-rank (end − warm) ÷ warm of resident memory, warm being after the first "
        "1,000 steps (allocator and autograd warm-up excluded), "
        "measured by each rank from /proc/self/status; the in-flight column sums every rank's outstanding "
        "requests after finish() (posted receives, unfinished sends, queued local messages). nan: async "
        "EASGD's server rank (rank 0) trains no steps, so it has no warm sample."
    )
    if not args.no_write:
        print(append_result("soak", "Soak and checkpoint I/O", table, notes))


if __name__ == "__main__":
    main()
