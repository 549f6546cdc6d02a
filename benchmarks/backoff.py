"""What the shared-memory wait's backoff (mpicrossbow/comm/backoff.py) costs and saves: whole digits jobs with
the backoff as shipped against the same jobs whose waits only ever yield (the behaviour before it), side by
side in interleaved pairs.

    python -m benchmarks.backoff [--pairs 5] [--no-write]

Three jobs, each run both ways, all with ``model.hidden=1024`` (300 KB of gradient, above the shared-memory
communicator's 64 KB threshold, so every step's allreduce goes through the waits the backoff paces):

- **plain**: 2 ranks, 3 epochs: an ordinary step's waits are short; the backoff must not slow it;
- **slowed**: 2 ranks, 4 epochs, rank 0 sleeping 20 ms a step (``session.slow_ranks=0``): rank 1 waits
  ~20 ms at every one of 176 steps, the case the backoff is for; CPU seconds should drop, wall not rise;
- **oversubscribed**: 4 ranks (more than this machine's cores when it has fewer than 4), 3 epochs.

"Yield only" is the same job with ``mpicrossbow.comm.backoff.YIELD_S`` set to infinity in every rank before
the run, so a wait never naps. Wall seconds are a monotonic clock around ``mpiexec``; CPU seconds are user +
system of it and every rank (getrusage of the children). Appends medians, min–max and the ratios to
``benchmarks/results/backoff.md``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shlex
import statistics
import sys
import tempfile
from collections.abc import Sequence

from benchmarks.report import RESULTS, machine
from benchmarks.startup import Samples, beside_interpreter, portable, run_once, spread, versions

log = logging.getLogger("benchmarks.backoff")

#: Each rank's program: the shipped backoff, or waits that only yield; then crossbow-launch's main.
PROGRAM = "import sys; {patch}from mpicrossbow.cli import main; sys.exit(main())"
YIELD_ONLY = "import mpicrossbow.comm.backoff as b; b.YIELD_S = float('inf'); "
#: Job → (ranks, overrides).
JOBS = {
    "plain": (2, ("session.epochs=3",)),
    "slowed": (2, ("session.epochs=4", "session.slow_ranks=0", "session.slow_seconds=0.02")),
    "oversubscribed": (4, ("session.epochs=3",)),
}


def job(label: str, ranks: int, overrides: Sequence[str], patch: str) -> Samples:
    """One way of running one job, as an ``mpiexec`` command line (the output folder is added per run)."""
    program = PROGRAM.format(patch=patch)
    argv = [beside_interpreter("mpiexec"), "-n", str(ranks), sys.executable, "-c", program]
    argv += ["-cfg", "launch/digits.cfg", "model.hidden=1024", "session.progress=off", *overrides]
    return Samples(label, argv)


def measure(pairs: list[tuple[Samples, Samples]], rounds: int) -> None:
    """One warm-up round, then ``rounds``; every round runs each pair in an order reversed every round."""
    for round_ in range(rounds + 1):
        for both in pairs:
            for samples in both if round_ % 2 == 0 else both[::-1]:
                with tempfile.TemporaryDirectory(prefix="backoff-bench-") as out:
                    wall, cpu = run_once([*samples.argv, f"session.output={out}"])
                if round_ > 0:
                    samples.wall.append(wall)
                    samples.cpu.append(cpu)
                log.info("round %d %s: wall %.2f s, CPU %.2f s", round_, samples.label, wall, cpu)


def table(pairs: list[tuple[Samples, Samples]]) -> str:
    """Markdown: each job both ways, and backoff ÷ yield only (medians of the per-pair ratios)."""
    lines = [
        "| job | wall s, median (min–max) | CPU s, median (min–max) | wall ratio | CPU ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for shipped, before in pairs:
        wall = statistics.median(a / b for a, b in zip(shipped.wall, before.wall, strict=True))
        cpu = statistics.median(a / b for a, b in zip(shipped.cpu, before.cpu, strict=True))
        lines.append(
            f"| {shipped.label} | {spread(shipped.wall)} | {spread(shipped.cpu)} | {wall:.2f}× | {cpu:.2f}× |"
        )
        lines.append(f"| {before.label} | {spread(before.wall)} | {spread(before.cpu)} | | |")
    return "\n".join(lines)


def pairs_args(module: str, doc: str | None, argv: Sequence[str] | None) -> argparse.Namespace:
    """Logging set up and the command line of a benchmark of interleaved pairs: ``--pairs``,
    ``--no-write``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--pairs", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table and (unless ``--no-write``) append it to the results."""
    args = pairs_args("benchmarks.backoff", __doc__, argv)
    pairs = [
        (job(f"{name}, backoff", ranks, extra, ""), job(f"{name}, yield only", ranks, extra, YIELD_ONLY))
        for name, (ranks, extra) in JOBS.items()
    ]
    load = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.timezone.utc)
    measure(pairs, args.pairs)
    result = table(pairs)
    print(result)
    if args.no_write:
        return 0
    invocation = shlex.join(["python", "-m", "benchmarks.backoff", *(sys.argv[1:] if argv is None else argv)])
    example = portable(shlex.join(pairs[1][1].argv))
    section = (
        f"\n## Shared-memory wait backoff against yield only — {started:%Y-%m-%d %H:%M} UTC\n\n"
        f"- command: `{invocation}`\n- versions: {versions()}\n- machine: {machine()}; 1-minute load "
        f"average {load:.1f} at the start\n- {args.pairs} interleaved rounds after 1 warm-up; ratios are "
        f"backoff ÷ yield only, medians of the pairs; e.g. `{example}`\n\n{result}\n"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "backoff.md"
    with path.open("a", encoding="utf-8") as f:
        f.write(("# backoff benchmark results\n" if f.tell() == 0 else "") + section)
    log.info("appended to %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
