"""The showdown: time to a target accuracy, DistributedDataParallel's best against mpicrossbow's best.

Crossbow's claim is that several small-batch learners per device, synchronised by model averaging, reach a
target accuracy sooner than one large-batch replica per device. This measures it on the grid of
benchmarks/tta.cfg, in one MPI job (torch starts once per rank), every run of both sides on the same
ranks, threads, data, held-out split, optimizer family and validation cadence:

* **DDP**: torch ``DistributedDataParallel`` over Gloo, one replica per rank, each global batch at each of
  its learning rates (:mod:`benchmarks.tta_ddp`);
* **mpicrossbow**: each rule × learners per rank × engine, through the framework's own path (a Config and a
  ``Session``, as ``crossbow-launch`` runs it) with ``[session] target_accuracy`` and ``validate_every``.

Time to target is training wall time until the first validation at or above the target (the slowest
rank's), validation time left out on both sides; a setup's time is the median over its seeds, a seed that
missed the target counting as slower than any that reached it. Output: benchmarks/results/tta.md (every
setup's median time and epochs to target, samples/s and final accuracy; the two winners side by side),
tta-<task>.png (accuracy against training time for the winners) and tta-runs.json (every run, so
``--report-only`` redraws without training).

    python -m benchmarks.tta                                   # the whole grid (hours on 2 cores)
    python -m benchmarks.tta --tasks mnist1d --seeds 0 --learners 1,4,16 --rules BSP,SMA
    python -m benchmarks.tta --report-only                     # the tables and plots from tta-runs.json

**On one GPU** (``--device cuda``; benchmarks/gpu.sh's step ``tta``, ``--out gpu``): the ``[cuda]`` plan
of tta.cfg in one process (a one-rank MPI job: the Session wants an MPI world), MNIST-1D to 94 %, the
task's schedule, 60-epoch cap and quarter-epoch validations on both sides:

* **PyTorch**: one replica, a plain single-process loop (:func:`benchmarks.tta_ddp.one_replica_run`; DDP in
  a world of one would only add its hooks), the split resident on the GPU, at 3 batch/rate pairs;
* **mpicrossbow**: BSP with ``[pool] engine = fused`` at 4 learners × batch configurations, CUDA graphs
  on (``[pool] cuda_graphs``, set where the framework has the key, which the section says).

Their ratio, best mpicrossbow ÷ best PyTorch, is set against the goal ≤ 0.5. Without CUDA one line says so
and the exit status is 0; ``--one-device --device cpu`` runs the same code on the CPU (the test's path).

How the plan was chosen, on the CPU (no GPU at hand): the winners of the 2-rank CPU grid (results/tta.md:
DDP at global batch 256 and lr 0.2, 128 and 0.1, 64 and 0.1; BSP with fused learners of batch 16 at the
same global batches and rates, 8 per rank winning) give the global batches and rates; results/tta.md and
results/epochs_to_target.md show the model-averaging rules need more epochs than BSP at every k and miss
at k = 16, so only BSP runs. One CPU run of this very plan at one process (seed 0, ``--one-device --device
cpu``) reached 94 % in every configuration: PyTorch batch 256 in 36.5 epochs, 128 in 25.3, 64 in 20.8;
BSP 16 × b16 in 29.5, 8 × b32 in 29.8, 8 × b16 in 26.5, 4 × b16 in 20.5. On a GPU a step of this 5,210-
parameter CNN costs about the same at any of these batches (launch-bound), so the steps to the target
decide: about 15 × 36.5 ≈ 550 for PyTorch at 256 and 445 for BSP 16 × b16, against 790–1,270 for the
smaller batches. The runs alternate sides, each side's likeliest winner first (tta.cfg's order), so a
step cut short still compares the two. One seed only: the step has about 90 s with start-up; expected
about 60 s (start-up and CUDA and NCCL initialisation about 10 s, a PyTorch run 2–4 s, an mpicrossbow run
8–12 s with its Session's set-up and ~120 validations). No run starts unless it fits before ``--seconds``
(gpu.sh's step limit, ``GPU_SH_STEP_SECONDS``) less a margin, at 1.25 × the longest run so far (at least
``[cuda] run_seconds``); the runs left out are listed. A run that fails is noted in the section and the
others go on (exit status 1).

    python -m benchmarks.tta --device cuda --out gpu          # benchmarks/gpu.sh's step tta
    python -m benchmarks.tta --one-device --device cpu --no-write   # the same plan on the CPU (~90 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import (
    RESULTS,
    add_seconds_argument,
    append_result,
    gpu_versions,
    relaunch,
    under_mpi,
    versions,
)
from benchmarks.tta_grid import (
    DDP,
    TORCH,
    XB,
    Grid,
    OneDevice,
    Row,
    Run,
    Setup,
    Task,
    alpha_value,
    load_grid,
    load_one_device,
    summarise,
    winners,
)  # fmt: skip

GRID = Path(__file__).with_name("tta.cfg")
RUNS = RESULTS / "tta-runs.json"
NARROWS = (
    "tasks", "seeds", "global_batches", "rules", "learners", "engines", "lr_scalings", "alphas", "tuners",
)  # fmt: skip
#: One device: the goal for best mpicrossbow ÷ best PyTorch (issue 49).
ONE_DEVICE_GOAL = 0.5
#: One device: seconds kept back from ``--seconds`` for the start of the job's process, the report and the
#: job's end (the deadline a run must fit before).
ONE_DEVICE_MARGIN_S = 8.0
#: One device: a run must fit this many times the longest run so far (or ``[cuda] run_seconds``) to start.
RUN_ESTIMATE_FACTOR = 1.25
#: One device: the environment variable the launcher hands the job's deadline down in (epoch seconds).
DEADLINE_VAR = "MPICROSSBOW_TTA_DEADLINE"


def digits_mlp() -> Any:
    """The default job's MLP (models/mlp.py) as a plain ``nn.Module``, for ``[data] dataset = digits``."""
    from models.mlp import MLP

    return MLP().module()


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options: the grid file, lists that narrow it, and what to do."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--grid", default=str(GRID), help="the grid file (default benchmarks/tta.cfg)")
    for key in NARROWS:
        parser.add_argument(
            f"--{key.replace('_', '-')}", dest=key, help=f"comma list replacing the grid's {key}"
        )
    parser.add_argument(
        "--runs",
        help="the JSON of every run (default results/tta-runs.json; one device: none unless given)",
    )
    parser.add_argument("--report-only", action="store_true", help="tables and plots from the runs' JSON")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds the whole MPI job may take")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write to results/")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the one-device showdown of [cuda] on GPU 0 (one process); cpu: the grid on CPU ranks",
    )
    parser.add_argument(
        "--one-device",
        action="store_true",
        help="the one-device showdown ([cuda]) on --device (cpu: its code path on the CPU, for tests)",
    )
    parser.add_argument(
        "--out",
        default="tta",
        help="results/<OUT>.md to append to (gpu.sh: gpu); an absolute /dir/NAME appends to /dir/NAME.md",
    )
    add_seconds_argument(
        parser, "one device: the whole command's time; no run starts unless it fits before the end"
    )
    args = parser.parse_args(argv)
    args.one_device = args.one_device or args.device == "cuda"
    if args.one_device and args.report_only:
        parser.error("--report-only redraws the CPU grid's runs; the one-device showdown has no such file")
    return args


def xb_run(world: Any, task: Task, setup: Setup, seed: int, grid: Grid, out: str) -> Run:
    """One mpicrossbow run of ``setup`` at ``seed`` through a Session, stopping at the target."""
    rule = dict(grid.rule_settings.get(setup.rule, {}))
    if setup.alpha:
        rule["alpha"] = alpha_value(setup.alpha, grid.ranks * setup.learners)
    pool: dict[str, Any] = {"learners": setup.learners, "engine": setup.engine}
    if setup.tune:
        pool.update(learners="auto", tune=setup.tune, max_learners=grid.max_learners)
    extra = session_settings(task, setup, seed, out, grid.threads, grid.validate_every, "cpu")
    return session_run(world, setup, {**extra, "pool": pool, "rule": rule})


def session_settings(
    task: Task, setup: Setup, seed: int, out: str, threads: int, every: float, devices: str
) -> dict[str, Any]:
    """The Config overrides of one mpicrossbow run but its ``[pool]`` and ``[rule]``: the task's model, data,
    SGD recipe and schedule, epoch cap, target and validation cadence, on ``devices`` (``cpu``, ``cuda0``)."""
    return {
        "__top__": {
            "rule": setup.rule,
            "modelfile": task.modelfile,
            "modelclass": task.modelclass,
            "devices": devices,
        },
        "session": {
            "epochs": task.max_epochs,
            "seed": seed,
            "output": out,
            "progress": "off",
            "log_level": "warning",
            "threads": threads,
            "validate_every": every,
            "target_accuracy": task.target,
            "on_nan": "skip",  # a diverging learning rate misses the target instead of ending the job
        },
        "optim": {
            "lr": setup.lr,
            "momentum": task.momentum,
            "weight_decay": task.weight_decay,
            "schedule": "multistep",
            "milestones": task.milestones,
            "gamma": task.gamma,
            "warmup_epochs": task.warmup_epochs,
            # the grid's rates are already scaled for k, except under a tuner that changes k (uncapped there,
            # knowingly, as these runs were measured: lr_scaling without lr_cap is refused otherwise)
            "lr_scaling": "sqrt" if setup.tune else "none",
            "lr_cap": 100.0 if setup.tune else 0.0,
        },
        "data": {"dataset": task.dataset, "batch_size": setup.batch},
    }


def session_run(world: Any, setup: Setup, extra: dict[str, Any]) -> Run:
    """Train ``extra`` (Config overrides) through a Session as ``crossbow-launch`` would; the Run of ``setup``
    (times are the slowest rank's)."""
    from mpi4py import MPI

    from mpicrossbow.config import load_config
    from mpicrossbow.training.run.session import Session

    seed = extra["session"]["seed"]
    session = Session(load_config(extra=extra), world)
    try:
        session.prepare_local()
        session.prepare_collective()
        result = session.run()
    finally:
        session.close()
    seconds = world.mpi.allreduce(result.target_seconds, op=MPI.MAX)
    trained = world.mpi.allreduce(result.train_seconds, op=MPI.MAX)
    if setup.tune:  # the learner count changed during the run: the job's own count of samples
        samples = result.samples_per_second * result.wall_seconds
    else:
        samples = result.steps * setup.learners * setup.batch * world.size
    curve = [tuple(p) for p in result.curve]
    return Run(setup, seed, seconds, result.target_epochs, samples / trained, result.val_accuracy, curve)


def train_all(grid: Grid, world: Any, path: Path) -> dict[str, list[Run]]:
    """Every run of the grid, task by task; rank 0 prints each and keeps the JSON at ``path`` current."""
    import torch

    from benchmarks.tta_ddp import ddp_run, tensors
    from mpicrossbow.comm.torchdist import TorchDistCommunicator

    torch.set_num_threads(grid.threads)
    group = TorchDistCommunicator.from_mpi(world.mpi, backend="gloo")  # DDP's default process group
    runs: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = world.mpi.bcast(tmp, root=0)
        for task in grid.tasks.values():
            data = (*tensors(task, "train"), *tensors(task, "val"))
            todo = [(s, seed) for s in grid.setups(task) for seed in grid.seeds]
            runs[task.name] = []
            for n, (setup, seed) in enumerate(todo, 1):
                started = time.perf_counter()
                if setup.side == DDP:
                    run = ddp_run(world, task, setup, seed, grid.validate_every, data)
                else:
                    run = xb_run(world, task, setup, seed, grid, out)
                runs[task.name].append(run)
                if world.rank == 0:
                    say(task, n, len(todo), run, time.perf_counter() - started)
                    save_runs(runs, path)
    group.close()
    return runs


def say(task: Task, n: int, of: int, run: Run, wall: float) -> None:
    """One line per run, as it ends: what it reached, how fast, and its wall time (set-up included)."""
    print(
        f"[{task.name} {n}/{of}] {run.setup.label} seed {run.seed}: "
        + (f"{run.seconds:.2f} s, {run.epochs:.2f} epochs" if run.reached else "missed")
        + f", {run.samples_per_s:,.0f} samples/s, final {run.final_accuracy:.4f} ({wall:.1f} s)",
        flush=True,
    )


def cuda_graphs_key() -> bool:
    """Whether this framework has ``[pool] cuda_graphs`` (the one-device showdown sets it where it does)."""
    from mpicrossbow.config.sections import PoolSection

    return any(f.name == "cuda_graphs" for f in dataclasses.fields(PoolSection))


def one_device_pool(plan: OneDevice, setup: Setup, device: str) -> dict[str, Any]:
    """``[pool]`` of an mpicrossbow run of the one-device plan: its learners and engine and, on a CUDA
    device where the framework has the key, ``cuda_graphs`` as ``[cuda] cuda_graphs`` says."""
    pool: dict[str, Any] = {"learners": setup.learners, "engine": setup.engine}
    if device == "cuda" and cuda_graphs_key():
        pool["cuda_graphs"] = plan.cuda_graphs
    return pool


def train_one_device(
    plan: OneDevice, world: Any, device: str, deadline: float, path: Path | None
) -> tuple[list[Run], list[tuple[Setup, int]], list[str]]:
    """Every run of the one-device plan on ``device`` (``cuda``: GPU 0), in the plan's order, in this one
    process; a run starts only if it fits before ``deadline`` (epoch seconds, 0: none) at
    :data:`RUN_ESTIMATE_FACTOR` × the longest run so far, at least ``[cuda] run_seconds``. A run that raises
    (``cuda_graphs = on`` where a graph cannot be captured, say) is noted and the next one starts, so the
    section is written whatever one configuration does. The runs, the (setup, seed) pairs left out for
    time, and one line per failed run."""
    import torch

    from benchmarks.tta_ddp import one_replica_run, tensors

    torch.set_num_threads(plan.threads)
    task, where = plan.task, torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    todo = [(setup, seed) for setup in plan.setups for seed in plan.seeds]
    runs: list[Run] = []
    skipped: list[tuple[Setup, int]] = []
    failed: list[str] = []
    longest = 0.0
    with tempfile.TemporaryDirectory() as out:
        data = (*tensors(task, "train"), *tensors(task, "val"))
        for n, (setup, seed) in enumerate(todo, 1):
            need = max(plan.run_seconds, RUN_ESTIMATE_FACTOR * longest)
            if deadline and time.time() + need > deadline:
                print(f"[{task.name} {n}/{len(todo)}] {setup.label} seed {seed}: not run (time)", flush=True)
                skipped.append((setup, seed))
                continue
            started = time.perf_counter()
            try:
                if setup.side == TORCH:
                    run = one_replica_run(task, setup, seed, plan.validate_every, data, where)
                else:
                    devices = "cuda0" if device == "cuda" else "cpu"
                    extra = session_settings(
                        task, setup, seed, out, plan.threads, plan.validate_every, devices
                    )
                    extra["pool"] = one_device_pool(plan, setup, device)
                    for section, values in plan.settings.items():
                        extra[section] = {**extra.get(section, {}), **values}
                    run = session_run(world, setup, extra)
            except Exception as exc:  # noted in the section; the other configurations still run
                logging.getLogger(__name__).exception("tta: %s seed %d failed", setup.label, seed)
                last = (str(exc).strip().splitlines() or [""])[-1][:300]
                failed.append(f"{setup.label} seed {seed}: {type(exc).__name__}: {last}")
                print(f"[{task.name} {n}/{len(todo)}] {failed[-1]}", flush=True)
                continue
            finally:
                longest = max(longest, time.perf_counter() - started)
            runs.append(run)
            say(task, n, len(todo), run, time.perf_counter() - started)
            if path is not None:
                save_runs({task.name: runs}, path)
    return runs, skipped, failed


def save_runs(runs: dict[str, list[Run]], path: Path) -> None:
    """Every run so far into ``path`` (written whole, then renamed: never half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({t: [r.as_dict() for r in rs] for t, rs in runs.items()}), encoding="utf-8")
    partial.replace(path)


def load_runs(path: Path) -> dict[str, list[Run]]:
    """The runs the JSON at ``path`` holds."""
    if not path.exists():
        raise SystemExit(f"tta: no {path}; run the grid first")
    return {t: [Run.from_dict(d) for d in rs] for t, rs in json.loads(path.read_text("utf-8")).items()}


def _time(seconds: float) -> str:
    return "missed" if math.isnan(seconds) else f"{seconds:.2f}"


def table(task: Task, rows: list[Row], sides: tuple[str, str] = (DDP, XB)) -> str:
    """Every setup of a task, fastest to the target first; each of ``sides``' winner (the baseline's, then
    mpicrossbow's) and their ratio."""
    lines = [
        f"### {task.name}: target {task.target:.0%} validation accuracy",
        "",
        "| side | configuration | reached | time to target (s) | epochs to target | samples/s "
        "| final accuracy |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        epochs = "–" if math.isnan(row.epochs) else f"{row.epochs:.2f}"
        lines.append(
            f"| {row.setup.side} | {row.setup.label} | {row.reached}/{row.seeds} | {_time(row.seconds)} | "
            f"{epochs} | {row.samples_per_s:,.0f} | {row.final_accuracy:.4f} |"
        )
    best = winners(rows)
    lines.append("")
    for side in sides:
        row = best.get(side)
        lines.append(
            f"- best {side}: "
            + (
                f"{row.setup.label}: {row.seconds:.2f} s ({row.epochs:.2f} epochs)"
                if row
                else "none reached it"
            )
        )
    base, ours = best.get(sides[0]), best.get(sides[1])
    if base and ours:
        lines.append(
            f"- best {sides[1]} ÷ best {sides[0]} time to target: **{ours.seconds / base.seconds:.2f}**"
        )
    return "\n".join(lines)


def plot(task: Task, rows: list[Row], path: Path) -> None:
    """Validation accuracy of each side's winner and of the best model-averaging setup (their median seed's
    run) against training time (left) and against epochs (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for name, row in drawn(rows).items():
        curve = row.median_run.curve
        for ax, x in zip(axes, (0, 1), strict=True):
            ax.plot(
                [p[x] for p in curve], [p[2] for p in curve], marker=".", label=f"{name}: {row.setup.label}"
            )
    for ax, xlabel in zip(axes, ("training time (s, validation left out)", "epochs"), strict=True):
        ax.axhline(task.target, color="grey", linestyle="--", linewidth=1, label=f"target {task.target:.0%}")
        ax.set_xlabel(xlabel)
        ax.set_ylim(max(0.0, task.target - 0.3), 1.0)
    axes[0].set_ylabel("validation accuracy")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{task.name}: to {task.target:.0%}, the fastest setup of each side and of model averaging")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def drawn(rows: list[Row]) -> dict[str, Row]:
    """What the plot draws: each side's winner and the fastest model-averaging setup (rule other than BSP)."""
    out = {side: row for side, row in winners(rows).items() if row is not None}
    averaging = [
        r for r in rows if r.setup.side == XB and r.setup.rule != "BSP" and not math.isnan(r.seconds)
    ]
    if averaging and averaging[0] is not out.get(XB):
        out["model averaging"] = averaging[0]
    return out


def report(grid: Grid, runs: dict[str, list[Run]], args: argparse.Namespace) -> None:
    """Print every task's table; unless --no-write append them to results/tta.md with one PNG per task."""
    sections = []
    for name, task_runs in runs.items():
        task = grid.tasks.get(name)
        if task is None:
            continue
        rows = summarise(task_runs)
        sections.append(table(task, rows))
        if not args.no_write:
            plot(task, rows, RESULTS / f"tta-{name}.png")
            sections.append(f"Plot: `tta-{name}.png`.")
    head = (
        f"{grid.ranks} ranks, {grid.threads} thread(s) each; seeds {', '.join(map(str, grid.seeds))}; "
        f"validation every {grid.validate_every:g} epoch on the held-out split, its time left out; time "
        "to target = the slowest rank's training time until the first validation at the target; medians "
        "over seeds (a missed target ranks last). Grid: benchmarks/tta.cfg as narrowed by the command."
    )
    text = "\n\n".join([head, *sections])
    print(text)
    if not args.no_write:
        print("appended to", append_result(args.out, "Time to accuracy: mpicrossbow against DDP", text))


def one_device_report(
    plan: OneDevice,
    runs: list[Run],
    skipped: list[tuple[Setup, int]],
    failed: list[str],
    args: argparse.Namespace,
) -> str:
    """The one-device section: how it was measured and chosen, every setup's row, each side's winner, the
    ratio against the goal; printed, and unless --no-write appended to results/<--out>.md."""
    task, cuda = plan.task, args.device == "cuda"
    rows = summarise(runs)
    if not cuda:
        graphs = "`[pool] cuda_graphs` not set (a CUDA setting; this run is on the CPU)"
    elif cuda_graphs_key():
        graphs = f"`[pool] cuda_graphs = {plan.cuda_graphs}`"
        if plan.cuda_graphs == "on":
            graphs += " (on: a step the framework cannot capture is an error, so every row ran as graphs)"
    else:
        graphs = "`[pool] cuda_graphs` not set (this framework has no such key: no CUDA graphs)"
    where = "one GPU (cuda:0)" if cuda else "the CPU (the one-device code path)"
    settings = ", ".join(f"`{sec}.{k}={v}`" for sec, kv in plan.settings.items() for k, v in kv.items())
    head = (
        f"On {where}, one process: plain PyTorch (one replica, the whole split resident on the device, "
        f"SGD, no DDP: a world of one would only add its hooks) against mpicrossbow's {plan.rule} with "
        f"`[pool] engine = {plan.engine}` and {graphs}, through a Session as crossbow-launch runs it. "
        f"Seed{'s' if len(plan.seeds) > 1 else ''} {', '.join(map(str, plan.seeds))}"
        f"{' only (the GPU step has about 90 s)' if len(plan.seeds) == 1 else ''}; both sides on one "
        f"schedule and epoch cap ({task.max_epochs}), validation every {plan.validate_every:g} epoch on the "
        "held-out split, its time left out (the baseline's clock waits for the device before it stops); "
        "time to target = training time until the first validation at the target. mpicrossbow's further "
        f"settings: {settings or 'none'}. Grid: benchmarks/tta.cfg [cuda], chosen on the CPU: the global "
        "batches and rates that won on 2 CPU ranks (results/tta.md), BSP alone (the model-averaging rules "
        "needed more epochs than BSP at every k, results/epochs_to_target.md); one CPU run of this plan "
        "reached 94 % in every configuration (benchmarks/tta.py's docstring)."
    )
    body = table(task, rows, (TORCH, XB))
    best = winners(rows)
    if best.get(TORCH) and best.get(XB):
        ratio = best[XB].seconds / best[TORCH].seconds
        body += (
            f"\n- goal ≤ {ONE_DEVICE_GOAL:g}: {'met' if ratio <= ONE_DEVICE_GOAL else 'not met'} "
            f"({ratio:.2f})"
        )
    else:
        body += f"\n- goal ≤ {ONE_DEVICE_GOAL:g}: no ratio (a side reached no target)"
    for line in failed:
        body += f"\n- failed: {line}"
    if skipped:
        left = "; ".join(f"{s.label} seed {seed}" for s, seed in skipped)
        body += f"\n- not run, the step's time being spent: {left}"
    text = f"{head}\n\n{body}"
    print(text, flush=True)
    if not args.no_write:
        title = f"Time to accuracy on {'one GPU' if cuda else 'one CPU process'}: mpicrossbow against PyTorch"
        line = f"{versions()}; {gpu_versions()}" if cuda else None
        print("appended to", append_result(args.out, title, text, versions_line=line), flush=True)
    return text


def cuda_available() -> bool:
    """torch.cuda.is_available(), asked in the launching process before the job starts."""
    import torch

    return torch.cuda.is_available()


def main_one_device(args: argparse.Namespace) -> int:
    """The one-device showdown: skip without CUDA (``--device cuda``), else re-launch as a one-rank MPI job
    (the framework's Session wants an MPI world) with the deadline, train the plan and report."""
    plan = load_one_device(args.grid, {"seeds": args.seeds} if args.seeds else None)
    if args.device == "cuda" and not under_mpi() and not cuda_available():
        print("tta on one GPU: needs a CUDA device, and this machine has none: skipped", flush=True)
        return 0
    if not under_mpi():  # the deadline goes down in the environment, so the recorded command stays as typed
        deadline = time.time() + args.seconds - ONE_DEVICE_MARGIN_S if args.seconds > 0 else 0.0
        os.environ[DEADLINE_VAR] = f"{deadline:.3f}"
        return relaunch(__spec__.name, 1, sys.argv[1:], timeout_s=args.timeout)
    from mpicrossbow.launch.world import detect_world
    from mpicrossbow.log import setup_logging

    world = detect_world()
    if world.size != 1:
        raise SystemExit(f"tta: the one-device showdown is one process, not {world.size}")
    setup_logging(world.rank, world.size, logging.WARNING)
    deadline = float(os.environ.get(DEADLINE_VAR) or 0)
    runs, skipped, failed = train_one_device(
        plan, world, args.device, deadline, Path(args.runs) if args.runs else None
    )
    one_device_report(plan, runs, skipped, failed, args)
    return 1 if failed else 0


def main() -> int:
    """Re-launch under mpiexec, train the grid, report on rank 0 (or only report, from tta-runs.json)."""
    args = parse_args(sys.argv[1:])
    if args.one_device:
        return main_one_device(args)
    grid = load_grid(args.grid, {k: getattr(args, k) for k in NARROWS if getattr(args, k)})
    runs_path = Path(args.runs or RUNS)
    if args.report_only:
        report(grid, load_runs(runs_path), args)
        return 0
    if not under_mpi():
        return relaunch(__spec__.name, grid.ranks, sys.argv[1:], timeout_s=args.timeout)
    from mpicrossbow.launch.world import detect_world
    from mpicrossbow.log import setup_logging

    world = detect_world()
    setup_logging(world.rank, world.size, logging.WARNING)
    runs = train_all(grid, world, runs_path)
    if world.rank == 0:
        report(grid, runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
