"""Fault drill: a rank that raises, or is SIGKILLed, must end the whole job quickly, named, every time.

Runs the digits job on 2 ranks ``--repeats`` times per fault (default 20) with the library's ``[fault]``
hook failing rank 1 at step 30, each run under a hard timeout, and records how long the job took to end,
its exit status, whether the failing rank was named (by our one-line message, or — for SIGKILL, which
leaves the rank no chance to speak — by the launcher's PID matched through the job's ``rank processes``
log line), and whether any process of the run survived. Writes ``benchmarks/results/faults.md``.

    python -m benchmarks.faults [--repeats 20]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import REPO, append_result

TIMEOUT_S = 60


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20, help="runs per fault")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/")
    return parser.parse_args()


def named(action: str, text: str) -> bool:
    """Whether the output names rank 1 as the one that failed."""
    if action != "kill":
        return any("crossbow-launch: error: rank 1 of 2" in line for line in text.splitlines())
    pids = re.search(r"rank processes: (.*)", text)
    dead = re.search(r"PID (\d+) RUNNING AT|process rank (\d+)", text)
    if pids is None or dead is None:
        return False
    table = dict(re.findall(r"(\d+): pid (\d+)", pids[1]))
    return dead[1] == table.get("1") or dead[2] == "1"


def survivors(marker: str) -> int:
    """Processes whose command line still mentions this run's output folder."""
    count = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                count += marker in (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
    return count


def drill(action: str) -> tuple[float, int, bool, int]:
    """(seconds to end, exit status, rank named, surviving processes) of one run."""
    here = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="fault-drill-") as out:
        cmd = [str(here / "mpiexec"), "-n", "2", str(here / "crossbow-launch"), "-cfg",
               "launch/digits.cfg", f"session.output={out}", "fault.rank=1", "fault.step=30",
               f"fault.action={action}"]  # fmt: skip
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return float("inf"), -1, False, survivors(out)
        elapsed = time.perf_counter() - start
        time.sleep(0.2)
        return elapsed, proc.returncode, named(action, proc.stdout + proc.stderr), survivors(out)


def main() -> None:
    args = parse_args()
    rows = [
        "| fault on rank 1 | runs | ended (non-zero exit) | rank named | hung (> 60 s) | processes left | "
        "seconds to end: median / max |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for action in ("raise", "kill"):
        results = [drill(action) for _ in range(args.repeats)]
        times = [r[0] for r in results]
        finite = [t for t in times if t != float("inf")]
        ended, named_ = sum(r[1] > 0 for r in results), sum(r[2] for r in results)
        rows.append(
            f"| {action} | {len(results)} | {ended} | {named_} | "
            f"{len(times) - len(finite)} | {sum(r[3] for r in results)} | "
            f"{statistics.median(finite):.1f} / {max(finite):.1f} |"
        )
        print(rows[-1], flush=True)
    notes = (
        "Each run includes MPI start-up and importing torch on both ranks (most of the seconds); the fault "
        "fires at step 30, well under a second into training."
    )
    if not args.no_write:
        print(
            append_result("faults", "Fault drill: one rank fails at step 30, 2 ranks", "\n".join(rows), notes)
        )


if __name__ == "__main__":
    main()
