"""Short real training runs per pool engine on the GPU, each final validation accuracy next to the CPU's.

For each cfg of ``--cfgs`` (default: the digits job, then the MNIST-1D CNN) and each engine (serial, fused,
streams) it runs the job a user runs, ``crossbow-launch -cfg CFG DEVICES=cuda0 pool.engine=E
pool.learners=4`` (one rank, as ``python -m mpicrossbow.cli``), then the same cfg with ``DEVICES=cpu0`` on
this machine's CPU: the CPU reference is measured in the same step, with the same code and libraries,
rather than quoted from another machine. The streams engine runs on CUDA only, so its CPU column is the
serial engine's CPU run. ``--bsp-staged`` adds BSP on **two ranks sharing the GPU** (``DEVICES=cuda0,cuda0
comm.backend=mpi``: NCCL refuses two ranks on one GPU, so every exchange of a CUDA buffer is staged through
pinned host memory, the path every pip user gets), against the same two ranks on CPU cores.

The MNIST-1D cfg runs 20 of its 50 epochs with its rate divided by 10 at epochs 12 and 16
(:data:`CFG_OVERRIDES`, on both sides), so that its runs fit a GPU step's minutes and end on a small rate,
where the accuracy has settled enough to compare two devices to within a point.

Every run's final validation accuracy and training seconds come from its metrics.h5; the table is appended
to results/gpu.md (``--out gpu``). benchmarks/gpu.sh runs it as one step, and its step limit
(``GPU_SH_STEP_SECONDS``) is this script's deadline: a run that would start too late is listed as not run,
so the table is written whatever the time allows. A run that hangs is stopped with SIGABRT first, so every
rank's Python stack (faulthandler) is printed into the step's log.

    python -m benchmarks.gpu_train                                  # every engine on cuda0, CPU references
    python -m benchmarks.gpu_train --device cpu --engines serial,fused --epochs 2 --no-write   # no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import REPO, append_result, gpu_versions, versions

#: Engines a run can use (streams: CUDA only).
ENGINES = ("serial", "fused", "streams")
#: What torch says on a machine without CUDA.
NO_CUDA = "torch.cuda.is_available() is False"
#: Seconds kept back from the deadline: a run is not started with less than this left.
MIN_RUN_SECONDS = 15
#: Seconds a stopped run has to print its stacks (SIGABRT) before it is killed.
ABORT_WAIT_SECONDS = 5
#: How much of a run's output is printed (the end).
OUTPUT_TAIL_CHARS = 6000


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cfgs",
        default="launch/digits.cfg,launch/mnist1d.cfg",
        help="comma list of session cfgs (paths in the repository), run in this order",
    )
    parser.add_argument(
        "--bsp-staged",
        action="store_true",
        help="also BSP on two ranks sharing the device (DEVICES=cuda0,cuda0 comm.backend=mpi), first cfg",
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="where the measured runs train"
    )
    parser.add_argument(
        "--engines", default="serial,fused,streams", help="comma list of serial,fused,streams"
    )
    parser.add_argument("--learners", type=int, default=4, help="[pool] learners of every run")
    parser.add_argument("--epochs", type=int, default=0, help="[session] epochs (0: the cfg's)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=float(os.environ.get("GPU_SH_STEP_SECONDS") or 900) - 10,
        help="start no run after this many seconds (default: gpu.sh's step limit less 10, else 890)",
    )
    parser.add_argument("--run-timeout", type=float, default=180, help="the most one run may take, seconds")
    parser.add_argument("--out", default="gpu", help="results/<OUT>.md to append to")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.cfgs = [c.strip() for c in args.cfgs.split(",") if c.strip()]
    if not args.cfgs:
        parser.error("--cfgs takes a comma list of cfg paths")
    if not args.engines or not set(args.engines) <= set(ENGINES):
        parser.error(f"--engines takes a comma list of {', '.join(ENGINES)}; got {args.engines}")
    if "streams" in args.engines and args.device != "cuda":
        parser.error("--engines streams needs --device cuda (the streams engine runs on CUDA devices only)")
    return args


#: Overrides a cfg's runs take on both devices (their reason is in the module docstring).
CFG_OVERRIDES = {"launch/mnist1d.cfg": ("session.epochs=20", "optim.milestones=12,16")}
#: The cfg a plan uses when none is named (the tests' and the table's default).
DIGITS = "launch/digits.cfg"


@dataclass(frozen=True)
class Job:
    """One training run: the engine, the device it trains on (``cuda0`` or ``cpu0``), the cfg, and the
    ranks (2: BSP on two ranks, ``cuda0,cuda0`` sharing the GPU through staged MPI, or ``cpu0,cpu1``)."""

    engine: str
    device: str
    cfg: str = DIGITS
    ranks: int = 1

    @property
    def devices(self) -> str:
        """The DEVICES value: one entry per rank."""
        if self.ranks == 1:
            return self.device
        kind = self.device.rstrip("0123456789")
        return ",".join(f"{kind}{0 if kind == 'cuda' else r}" for r in range(self.ranks))

    @property
    def name(self) -> str:
        """The run folder's name (unique in a plan)."""
        ranks = "" if self.ranks == 1 else f"-{self.ranks}ranks"
        return f"{Path(self.cfg).stem}-{self.engine}-{self.device}{ranks}"


@dataclass
class Outcome:
    """What one run reached (``None`` where it did not finish) and, when it failed, why."""

    accuracy: float | None = None
    train_seconds: float | None = None
    error: str | None = None


def plan(
    engines: list[str], device: str, cfgs: list[str] | None = None, bsp_staged: bool = False
) -> list[Job]:
    """The runs in order, cfg by cfg: each engine on ``device`` (``cuda`` → cuda0, ``cpu`` → cpu0), followed
    on CUDA by its CPU reference, except the streams engine's (CUDA only: the serial engine's CPU run
    serves); with ``bsp_staged``, after the first cfg's runs, BSP on two ranks and (on CUDA) its CPU pair."""
    jobs = []
    for index, cfg in enumerate(cfgs or [DIGITS]):
        for engine in engines:
            jobs.append(Job(engine, f"{device}0", cfg))
            if device == "cuda" and engine != "streams":
                jobs.append(Job(engine, "cpu0", cfg))
        if device == "cuda" and "streams" in engines and "serial" not in engines:
            jobs.append(Job("serial", "cpu0", cfg))
        if bsp_staged and index == 0:
            engine = "fused" if "fused" in engines else engines[0].replace("streams", "serial")
            jobs.append(Job(engine, f"{device}0", cfg, ranks=2))
            if device == "cuda":
                jobs.append(Job(engine, "cpu0", cfg, ranks=2))
    return jobs


def command(job: Job, args: argparse.Namespace, out: Path) -> list[str]:
    """The launcher command of ``job``: the cfg with the device, engine and learners as overrides."""
    overrides = [
        f"DEVICES={job.devices}",
        *CFG_OVERRIDES.get(job.cfg, ()),
        f"pool.engine={job.engine}",
        f"pool.learners={args.learners}",
        f"session.output={out}",
        f"session.name={job.name}",
        "session.progress=off",
    ]
    if job.ranks > 1:
        overrides += ["RULE=BSP", "comm.backend=mpi"]
    if args.epochs:
        overrides.append(f"session.epochs={args.epochs}")
    return [sys.executable, "-m", "mpicrossbow.cli", "-cfg", job.cfg, *overrides]


def run(job: Job, args: argparse.Namespace, out: Path, timeout: float) -> Outcome:
    """Run ``job`` in its own process group (a timeout ends the launcher, mpiexec and the rank together) and
    read its metrics.h5."""
    from mpicrossbow.training.reporting.metrics import read_metrics

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        PYTHONFAULTHANDLER="1",  # a run stopped with SIGABRT prints every thread's stack
    )
    proc = subprocess.Popen(
        command(job, args, out),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGABRT to the rank first (the innermost processes), so faulthandler prints where it was stuck while
        # mpiexec still forwards its output, then to the rest, then SIGKILL
        for pid in leaves_first(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
            time.sleep(0.5)
        try:
            output, _ = proc.communicate(timeout=ABORT_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        print(f"== gpu_train: {job.name}: stopped after {timeout:.0f} s; its output:", flush=True)
        print((output or "").rstrip()[-OUTPUT_TAIL_CHARS:], flush=True)
        for fault in sorted((out / job.name).rglob("*.fault")):  # the watchdog routes a rank's stack there
            print(f"== gpu_train: {fault.name}:\n{fault.read_text(errors='replace')[-OUTPUT_TAIL_CHARS:]}")
        return Outcome(error=f"stopped after {timeout:.0f} s")
    print(output.rstrip()[-OUTPUT_TAIL_CHARS:], flush=True)
    if proc.returncode != 0:
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        return Outcome(error=f"exit status {proc.returncode}: {last[0][-200:]}")
    attrs = read_metrics(out / job.name / "metrics.h5")["attrs"]
    return Outcome(float(attrs["val_accuracy"]), float(attrs.get("train_seconds", float("nan"))))


def leaves_first(root: int) -> list[int]:
    """``root`` and its descendants (read from /proc), children before their parents."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    order: list[int] = []

    def visit(pid: int) -> None:
        for child in parents.get(pid, []):
            visit(child)
        order.append(pid)

    visit(root)
    return order


def cell(outcome: Outcome | None, what: str) -> str:
    """One table cell: accuracy in %, or training seconds; the reason where the run has no result."""
    if outcome is None:
        return "not run (the step's time was spent)"
    if outcome.error is not None:
        return f"failed: {outcome.error}".replace("|", "/")
    value = outcome.accuracy if what == "accuracy" else outcome.train_seconds
    return "–" if value is None else (f"{100 * value:.2f} %" if what == "accuracy" else f"{value:.1f}")


def reference(job: Job) -> Job:
    """The CPU run a CUDA run is compared with: the same cfg, engine and ranks on CPU cores (the serial
    engine's for streams, which runs on CUDA only)."""
    return Job("serial" if job.engine == "streams" else job.engine, "cpu0", job.cfg, job.ranks)


def table(outcomes: dict[Job, Outcome], jobs: list[Job], device: str, learners: int) -> str:
    """One row per measured run of ``jobs`` (the plan): on CUDA, the CPU reference beside it."""
    measured = [job for job in jobs if job.device == f"{device}0"]
    if device != "cuda":
        lines = [
            "| cfg | engine | ranks | learners | cpu0 final val accuracy | cpu0 training s |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for job in measured:
            here = outcomes.get(job)
            lines.append(
                f"| {job.cfg} | {job.engine} | {job.ranks} | {learners} | {cell(here, 'accuracy')} "
                f"| {cell(here, 'seconds')} |"
            )
        return "\n".join(lines)
    lines = [
        "| cfg | engine | ranks | learners | cuda0 final val accuracy | cpu final val accuracy (same cfg) "
        "| cuda − cpu, points | cuda0 training s | cpu training s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for job in measured:
        here, ref = outcomes.get(job), outcomes.get(reference(job))
        diff = "–"
        if here and ref and here.accuracy is not None and ref.accuracy is not None:
            diff = f"{100 * (here.accuracy - ref.accuracy):+.2f}"
        shared = job.engine == "streams" and ref is not None
        ref_acc = cell(ref, "accuracy") + (" (serial's)" if shared else "")
        ranks = f"{job.ranks} (one GPU, staged MPI)" if job.ranks > 1 else "1"
        lines.append(
            f"| {job.cfg} | {job.engine} | {ranks} | {learners} | {cell(here, 'accuracy')} | {ref_acc} "
            f"| {diff} | {cell(here, 'seconds')} | {cell(ref, 'seconds')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the plan within the deadline, print the table and append it to results/<out>.md."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"benchmarks.gpu_train: --device cuda needs a CUDA device, and {NO_CUDA}")
    jobs = plan(args.engines, args.device, args.cfgs, args.bsp_staged)
    outcomes: dict[Job, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_train-") as tmp:
        for job in jobs:
            left = args.seconds - (time.monotonic() - start)
            if left < MIN_RUN_SECONDS:
                print(
                    f"== gpu_train: {job.name} not started: {left:.0f} s left of {args.seconds:.0f}",
                    flush=True,
                )
                continue
            print(f"== gpu_train: {job.name}", flush=True)
            outcomes[job] = outcome = run(job, args, Path(tmp), min(args.run_timeout, left))
            print(f"== gpu_train: {job.name}: {cell(outcome, 'accuracy')}", flush=True)
    epochs = f"session.epochs={args.epochs}" if args.epochs else "the cfg's epochs"
    special = "; ".join(f"{cfg}: `{' '.join(o)}`" for cfg, o in CFG_OVERRIDES.items() if cfg in args.cfgs)
    head = (
        f"{', '.join(f'`{c}`' for c in args.cfgs)} through the launcher (`python -m mpicrossbow.cli`) with "
        f"`DEVICES={args.device}0 pool.engine=E pool.learners={args.learners} session.progress=off`, {epochs}"
        + (f" ({special}, on both devices)" if special else "")
        + (
            "; two ranks: `DEVICES=cuda0,cuda0 RULE=BSP comm.backend=mpi` (both on the one GPU, every "
            "exchange staged through pinned host memory), against `cpu0,cpu1`"
            if args.bsp_staged
            else ""
        )
        + (
            "; the CPU column is the same cfg on this machine's CPU, run in this step "
            "(the streams engine runs on CUDA only: its CPU column is the serial engine's run)."
            if args.device == "cuda"
            else "."
        )
    )
    text = head + "\n\n" + table(outcomes, jobs, args.device, args.learners)
    print(text)
    if not args.no_write:
        line = f"{versions()}; {gpu_versions()}" if args.device == "cuda" else None
        title = "Training runs per engine" + (", on the GPU against the CPU" if args.device == "cuda" else "")
        print("appended to", append_result(args.out, title, text, versions_line=line))
    finished = [o for o in outcomes.values() if o.error is None]
    return 0 if len(finished) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
