"""Start-up cost of a whole small job: ``crossbow-launch`` on the 1-epoch digits job against the floor of any
MPI + PyTorch job, ``mpiexec -n 2 python -c 'import torch, mpi4py.MPI'``.

    python -m benchmarks.startup [--pairs 5] [--ranks 2] [--optim-floor] [--launch CMD] [--baseline DIR]
                                 [--no-write]

Run from the repository root (the job reads ``launch/digits.cfg`` and ``models.mlp`` from there). Both
commands are whole processes, started the way a user starts them: the ``crossbow-launch`` and ``mpiexec``
next to this interpreter, the job with ``-np RANKS`` (the floor starts as many ranks), one epoch, progress
off and a fresh temporary output folder. They run in interleaved pairs after one warm-up pair, the order
swapped every pair (job, floor, floor, job, ...). Wall seconds are a monotonic clock around each process;
CPU seconds are user + system of the process and every descendant it waited for (getrusage of the
children). Medians, min–max and the ratios job ÷ floor (of the medians, and the median of the per-pair
ratios) are printed and appended to ``benchmarks/results/startup.md``.

``--optim-floor`` adds a third process to every round: the floor plus building one ``torch.optim.SGD``
(PyTorch imports ``torch._dynamo`` when an optimizer is built or steps), the least any rank that trains
with a torch optimizer costs.

``--baseline DIR`` adds the same job run from another checkout, in it and with its own virtual environment
(``DIR/.venv/bin/crossbow-launch`` in ``DIR``: the ranks import ``mpicrossbow`` from their working folder)
to every round, and the ratio job ÷ baseline: a start-up change measured side by side. For an older
commit: ``git worktree add DIR COMMIT && cd DIR && python3 -m venv .venv && .venv/bin/pip install -c
constraints.txt -e '.[mpich]'``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import REPO, RESULTS, machine

log = logging.getLogger("benchmarks.startup")

#: The floor's Python code, and the floor with the cost of building a torch optimizer added.
FLOOR_CODE = "import torch, mpi4py.MPI"
OPTIM_FLOOR_CODE = (
    "import torch, mpi4py.MPI; torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)"
)
#: Seconds one process may take before the benchmark gives up.
RUN_TIMEOUT_S = 600.0


@dataclass
class Samples:
    """One command's measurements: wall and CPU seconds per run."""

    label: str
    argv: list[str]
    #: Whether the command is a job, which gets a fresh ``session.output`` folder each run.
    job: bool = False
    #: The folder it runs in (None: this one).
    cwd: Path | None = None
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.startup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pairs", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the job and of the floor (default 2)")
    parser.add_argument("--cfg", default="launch/digits.cfg", help="the job's cfg (default: the digits job)")
    parser.add_argument(
        "--launch",
        help="the crossbow-launch command (default: the crossbow-launch next to this interpreter)",
    )
    parser.add_argument(
        "--optim-floor", action="store_true", help="also time the floor plus building one torch optimizer"
    )
    parser.add_argument(
        "--baseline",
        help="also time the job from this checkout (PYTHONPATH), e.g. a worktree of an old commit",
    )
    parser.add_argument("--note", default="", help="a line added to the results (what was measured)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.warmup < 0 or args.ranks < 1:
        parser.error("--pairs and --ranks must be at least 1, --warmup at least 0")
    return args


def beside_interpreter(name: str) -> str:
    """The program ``name`` next to this interpreter (a venv's bin/), else on PATH; exits if neither."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if found is None:
        sys.exit(f"no {name} next to {sys.executable} or on PATH")
    return found


def run_once(argv: list[str], cwd: Path | None = None) -> tuple[float, float]:
    """Run ``argv`` to completion (in ``cwd``); its (wall, CPU) seconds. Exits with its output if it fails."""
    with tempfile.TemporaryFile() as output:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(argv, stdout=output, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, cwd=cwd)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            output.seek(0)
            tail = output.read()[-3000:].decode(errors="replace")
            sys.exit(f"exit status {proc.returncode} from {shlex.join(argv)}:\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(commands: list[Samples], pairs: int, warmup: int) -> None:
    """Interleaved rounds, each command once per round, the order reversed every other round."""
    for round_ in range(warmup + pairs):
        order = commands if round_ % 2 == 0 else commands[::-1]
        for samples in order:
            argv = samples.argv
            with tempfile.TemporaryDirectory(prefix="startup-bench-") as out:
                if samples.job:
                    argv = [*argv, f"session.output={out}"]
                wall, cpu = run_once(argv, samples.cwd)
            if round_ >= warmup:
                samples.wall.append(wall)
                samples.cpu.append(cpu)
            log.info(
                "%s %d/%d %s: wall %.2f s, CPU %.2f s",
                "warm-up" if round_ < warmup else "round",
                round_ + 1 - (0 if round_ < warmup else warmup),
                warmup if round_ < warmup else pairs,
                samples.label,
                wall,
                cpu,
            )


def versions() -> str:
    """Python, torch, mpi4py and MPI library versions, from a child process (MPI starts there, not here)."""
    proc = subprocess.run(
        [sys.executable, "-c", "from benchmarks.report import versions; print(versions())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    return proc.stdout.strip() or f"unknown ({proc.stderr.strip()[-200:]})"


def spread(values: list[float]) -> str:
    """``median (min–max)`` with two decimals."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def table(commands: list[Samples], job: Samples, floors: list[Samples]) -> str:
    """The Markdown table: wall and CPU per command, then job ÷ each of the others (``floors``)."""
    lines = [
        "| process | wall s, median (min–max) | CPU s, median (min–max) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {s.label} | {spread(s.wall)} | {spread(s.cpu)} |" for s in commands]
    lines += [
        "",
        "| ratio | wall: of medians | wall: median of pairs (min–max) | CPU: of medians |",
        "|---|---:|---:|---:|",
    ]
    for floor in floors:
        pairs = [a / b for a, b in zip(job.wall, floor.wall, strict=True)]
        lines.append(
            f"| job ÷ {floor.label} | {statistics.median(job.wall) / statistics.median(floor.wall):.2f}× | "
            f"{statistics.median(pairs):.2f}× ({min(pairs):.2f}–{max(pairs):.2f}) | "
            f"{statistics.median(job.cpu) / statistics.median(floor.cpu):.2f}× |"
        )
    return "\n".join(lines)


def write(text: str) -> Path:
    """Append one section to ``results/startup.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "startup.md"
    with path.open("a", encoding="utf-8") as f:
        if f.tell() == 0:
            f.write("# startup benchmark results\n")
        f.write(text)
    return path


def portable(command: str, baseline: str | None = None) -> str:
    """``command`` without this machine's paths: the interpreter's folder becomes ``$BIN``, the baseline
    checkout ``$BASELINE``."""
    if baseline:
        command = command.replace(str(Path(baseline).resolve()), "$BASELINE")
    return command.replace(str(Path(sys.executable).parent) + "/", "$BIN/")


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table and (unless ``--no-write``) append it to the results."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    mpiexec = beside_interpreter("mpiexec")
    launch = shlex.split(args.launch) if args.launch else [beside_interpreter("crossbow-launch")]
    job_argv = [*launch, "-cfg", args.cfg, "-np", str(args.ranks), "session.epochs=1", "session.progress=off"]
    job = Samples("job", job_argv, job=True)
    floor = Samples("floor", [mpiexec, "-n", str(args.ranks), sys.executable, "-c", FLOOR_CODE])
    floors = [floor]
    if args.baseline:
        launcher = Path(args.baseline).resolve() / ".venv" / "bin" / "crossbow-launch"
        if not launcher.is_file():
            sys.exit(f"--baseline {args.baseline}: no {launcher} (a checkout with its own .venv; see --help)")
        baseline = Samples("baseline job", [str(launcher), *job_argv[1:]], job=True, cwd=launcher.parents[2])
        floors.insert(0, baseline)
    if args.optim_floor:
        optim = [mpiexec, "-n", str(args.ranks), sys.executable, "-c", OPTIM_FLOOR_CODE]
        floors.append(Samples("floor + optimizer", optim))
    commands = [job, *floors]
    load_before = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.timezone.utc)
    measure(commands, args.pairs, args.warmup)
    result = table(commands, job, floors)
    print(result)
    if args.no_write:
        return 0
    invocation = portable(
        shlex.join(["python", "-m", "benchmarks.startup", *(sys.argv[1:] if argv is None else argv)]),
        args.baseline,
    )
    described = "\n".join(
        f"- {s.label}: `{portable(shlex.join(s.argv), args.baseline)}`{' (in $BASELINE)' if s.cwd else ''}"
        for s in commands
    )
    note = f"\n- note: {args.note}" if args.note else ""
    section = (
        f"\n## 1-epoch digits job vs the import floor — {started:%Y-%m-%d %H:%M} UTC\n\n"
        f"- command: `{invocation}`\n- versions: {versions()}\n- machine: {machine()}; "
        f"1-minute load average {load_before:.1f} at the start\n"
        f"- {args.pairs} interleaved rounds after {args.warmup} warm-up, order reversed every round; "
        f"the job adds `session.output=<a new temporary folder>`{note}\n{described}\n\n{result}\n"
    )
    log.info("appended to %s", write(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
