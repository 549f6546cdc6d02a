"""Where the test suite's CPU goes: run a pytest command while sampling every process of the machine once a
second, then count the processes and their CPU seconds by kind and by test file.

    python -m benchmarks.suite_cpu                      # the README's test command: results/suite_cpu.md
    python -m benchmarks.suite_cpu --no-write -- -m quick -n 2
    python -m benchmarks.suite_cpu --dump /tmp/procs.json    # and every process, for a census by test

Each process is read from ``/proc/<pid>/stat`` (user + system CPU, the largest value seen while it lived:
up to a second of a process's end is missed, and a process that lives less than a second may be missed
whole) and, once, its command line and the ``PYTEST_CURRENT_TEST`` it inherited (which test started it).
The machine's own totals come from ``/proc/stat`` around the run. The kinds: Python processes (ranks,
launchers, the tests' own scripts, pytest's workers; those that import torch pay ~1.6 s of CPU for it and
~1.5 s more for ``torch._dynamo`` once they build an optimizer, benchmarks/results/startup.md), MPI's
launchers and daemons, Slurm's and munge's daemons, and the rest (the kernel's threads, the machine's own
services). For the suite's length on 2 cores, the total against twice the wall time is what counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import REPO, append_result

#: The README's test command after the interpreter: ``python -m pytest`` and these.
DEFAULT_ARGS = ("-q", "-n", "2")
#: Process names by kind (``/proc/<pid>/comm``, at most 15 characters).
KINDS = {
    "python": ("python", "python3", "crossbow-launch", "crossbow-report", "crossbow-pack", "pt_data_worker"),
    "MPI launchers and daemons": ("mpiexec", "mpiexec.hydra", "hydra_pmi_proxy", "prterun", "prted"),
    "Slurm and munge": ("slurmctld", "slurmd", "slurmstepd", "munged", "srun", "sbatch", "scontrol"),
}


@dataclass
class Process:
    """One process seen by the sampler: its name, command line, the test that started it, its CPU seconds."""

    comm: str
    cmd: str
    test: str
    cpu: float = 0.0
    #: CPU seconds it had already used when the run started (0 for a process started during it).
    before: float = 0.0

    @property
    def kind(self) -> str:
        """Its kind (:data:`KINDS`), ``other`` when none."""
        return next((kind for kind, names in KINDS.items() if self.comm in names), "other")


def machine_cpu() -> list[int]:
    """The machine's CPU ticks so far: user, nice, system, idle, iowait, irq, softirq."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:8]]


def first_sight(pid: str) -> tuple[str, str]:
    """The command line of ``pid`` and the test it inherited (``PYTEST_CURRENT_TEST``); empty: unreadable."""
    cmd = test = ""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()[:300].replace(b"\0", b" ").decode(errors="replace")
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"PYTEST_CURRENT_TEST="):
                test = item.split(b"=", 1)[1].decode(errors="replace")
    except OSError:
        pass
    return cmd, test


def sample(seen: dict[str, Process], hz: int, start: bool = False) -> None:
    """Read every live process once into ``seen`` (keyed by pid and start time); at the ``start``, what each
    has used so far is its :attr:`Process.before`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        close = text.rfind(")")
        fields = text[close + 2 :].split()
        key = f"{pid}:{fields[19]}"
        if key not in seen:
            seen[key] = Process(text[text.find("(") + 1 : close], *first_sight(pid))
        seen[key].cpu = max(seen[key].cpu, (int(fields[11]) + int(fields[12])) / hz)
        if start:
            seen[key].before = seen[key].cpu


def run_sampled(args: list[str], period_s: float = 1.0) -> tuple[int, float, list[int], list[Process]]:
    """Run ``python -m pytest args`` from the repository root while sampling; its status, wall seconds, the
    machine's CPU ticks over the run and every process seen."""
    seen: dict[str, Process] = {}
    hz = os.sysconf("SC_CLK_TCK")
    done = threading.Event()

    def loop() -> None:
        while not done.wait(period_s):
            sample(seen, hz)

    sampler = threading.Thread(target=loop, daemon=True)
    sample(seen, hz, start=True)
    before, started = machine_cpu(), time.monotonic()
    sampler.start()
    status = subprocess.call([sys.executable, "-m", "pytest", *args], cwd=REPO)
    done.set()
    sampler.join()
    wall, after = time.monotonic() - started, machine_cpu()
    own = os.getpid()
    procs = [p for key, p in seen.items() if key.split(":")[0] != str(own)]
    for p in procs:
        p.cpu -= p.before
    return status, wall, [b - a for a, b in zip(before, after, strict=True)], procs


def tables(wall: float, ticks: list[int], procs: list[Process]) -> str:
    """The machine's CPU, the processes by kind and the test files by their processes' CPU, as markdown."""
    hz = os.sysconf("SC_CLK_TCK")
    user, system, idle = (ticks[0] + ticks[1]) / hz, (ticks[2] + ticks[5] + ticks[6]) / hz, ticks[3] / hz
    lines = [
        "| wall s | machine CPU s (user + system) | idle s | CPU ÷ (2 × wall) |",
        "|---:|---:|---:|---:|",
        f"| {wall:.0f} | {user + system:.0f} ({user:.0f} + {system:.0f}) | {idle:.0f} | "
        f"{(user + system) / (2 * wall):.2f} |",
        "",
        "| kind | processes | CPU s | median CPU s a process |",
        "|---|---:|---:|---:|",
    ]
    kinds = collections.defaultdict(list)
    for p in procs:
        kinds[p.kind].append(p.cpu)
    for kind in (*KINDS, "other"):
        cpus = kinds.get(kind, [])
        median = statistics.median(cpus) if cpus else 0.0
        lines.append(f"| {kind} | {len(cpus)} | {sum(cpus):.0f} | {median:.2f} |")
    python = [p for p in procs if p.kind == "python"]
    lines.append(
        f"\nPython processes of ≥ 1.5 CPU s (torch imported, most with an optimizer built): "
        f"{sum(1 for p in python if p.cpu >= 1.5)}, {sum(p.cpu for p in python if p.cpu >= 1.5):.0f} CPU s\n"
    )
    files: dict[str, list[float]] = collections.defaultdict(list)
    for p in procs:
        if p.test:
            files[p.test.split("::")[0]].append(p.cpu)
    lines += ["| test file (processes it started) | processes | CPU s |", "|---|---:|---:|"]
    for name, cpus in sorted(files.items(), key=lambda item: -sum(item[1]))[:20]:
        lines.append(f"| {name} | {len(cpus)} | {sum(cpus):.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run, print the tables, append them to results/suite_cpu.md unless ``--no-write``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    parser.add_argument(
        "--dump", type=Path, help="also write every process seen (test, command line, CPU s) to this JSON"
    )
    parser.add_argument("pytest_args", nargs="*", help="pytest's arguments after --")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args or list(DEFAULT_ARGS)
    status, wall, ticks, procs = run_sampled(pytest_args)
    if args.dump:
        rows = [{"comm": p.comm, "cmd": p.cmd, "test": p.test, "cpu": round(p.cpu, 2)} for p in procs]
        args.dump.write_text(json.dumps(rows), encoding="utf-8")
    table = tables(wall, ticks, procs)
    print(table)
    if not args.no_write:
        notes = (
            f"`python -m pytest {' '.join(pytest_args)}` (status {status}) sampled once a second: each "
            "process's largest user + system CPU seen, so a second of each end and processes shorter than a "
            "second may be missed; the kinds by process name."
        )
        append_result("suite_cpu", "The test suite's CPU by process", table, notes)
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
