"""Two one-process trainings sharing a machine's cores, each with a thread per core (torch's default) against
each with its share (``OMP_NUM_THREADS`` = cores ÷ 2): what two pytest workers, or two jobs on one node, see.

    python -m benchmarks.shared_cores [--rounds 6] [--no-write]

The job is the plain example, one process (``examples/train_digits.py --dataset mnist1d --epochs 3``). A
round starts two copies at once and times each (a monotonic clock around the process); the two settings
alternate round by round, after one warm-up round of each. One copy alone, with the default threads, is the
reference. With a thread per core in both processes, OpenMP's threads spin and wait for one another at
every parallel region while the other process holds the core, so single runs stretch far past twice the
time alone. Appends medians, the slowest run and the runs past 2.5× the time alone to
``benchmarks/results/shared_cores.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from benchmarks.report import append_result
from benchmarks.startup import portable

log = logging.getLogger("benchmarks.shared_cores")

JOB = [sys.executable, "examples/train_digits.py", "--dataset", "mnist1d", "--epochs", "3"]
#: A run past this many times the time alone counts as stretched.
STRETCHED = 2.5


def timed(copies: int, env: Mapping[str, str]) -> list[float]:
    """Start ``copies`` copies of the job at once; the wall seconds of each."""
    started = time.monotonic()
    procs = [
        subprocess.Popen(JOB, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(copies)
    ]
    times = []
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(JOB)} failed ({proc.returncode}): {err[-2000:]}")
        times.append(time.monotonic() - started)
    return times


def settings() -> dict[str, dict[str, str]]:
    """The environments compared: torch's default threads, and each process its share of the cores."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    return {
        "a thread per core each (default)": base,
        f"OMP_NUM_THREADS={share} each": {**base, "OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share},
    }


def measure(rounds: int) -> tuple[float, dict[str, list[float]]]:
    """The job alone (median of 3), then ``rounds`` rounds of two copies per setting, alternating."""
    envs = settings()
    default = next(iter(envs.values()))
    alone = statistics.median(timed(1, default)[0] for _ in range(3))
    log.info("alone: %.2f s", alone)
    runs: dict[str, list[float]] = {label: [] for label in envs}
    for round_ in range(rounds + 1):
        for label, env in envs.items() if round_ % 2 == 0 else reversed(envs.items()):
            got = timed(2, env)
            if round_ > 0:
                runs[label].extend(got)
            log.info("round %d, %s: %s", round_, label, ", ".join(f"{t:.1f} s" for t in got))
    return alone, runs


def table(alone: float, runs: Mapping[str, list[float]]) -> str:
    """Markdown: per setting, the runs' median, slowest, and how many stretched past STRETCHED × alone."""
    lines = [
        f"| two copies at once | runs | median s | slowest s | past {STRETCHED:g}× alone |",
        "|---|---:|---:|---:|---:|",
        f"| (one copy alone) | 3 | {alone:.2f} | | |",
    ]
    for label, times in runs.items():
        stretched = sum(t > STRETCHED * alone for t in times)
        lines.append(
            f"| {label} | {len(times)} | {statistics.median(times):.2f} | {max(times):.2f} | {stretched} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table and (unless ``--no-write``) append it to the results."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shared_cores", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per setting (default 6)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    load = os.getloadavg()[0]
    alone, runs = measure(args.rounds)
    result = table(alone, runs)
    print(result)
    if args.no_write:
        return 0
    notes = (
        f"Job: `{portable(shlex.join(JOB))}`; {args.rounds} rounds per setting after 1 warm-up, alternating; "
        f"a run's seconds from the round's start to its exit; 1-minute load average {load:.1f} at the start."
    )
    path = append_result("shared_cores", "Two one-process jobs on shared cores", result, notes)
    log.info("appended to %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
