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
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS, append_result, relaunch, under_mpi
from benchmarks.tta_grid import (
    DDP,
    XB,
    Grid,
    Row,
    Run,
    Setup,
    Task,
    alpha_value,
    load_grid,
    summarise,
    winners,
)  # fmt: skip

GRID = Path(__file__).with_name("tta.cfg")
RUNS = RESULTS / "tta-runs.json"
NARROWS = (
    "tasks", "seeds", "global_batches", "rules", "learners", "engines", "lr_scalings", "alphas", "tuners",
)  # fmt: skip


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
        "--runs", default=str(RUNS), help="the JSON of every run (default results/tta-runs.json)"
    )
    parser.add_argument("--report-only", action="store_true", help="tables and plots from the runs' JSON")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds the whole MPI job may take")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write to results/")
    return parser.parse_args(argv)


def xb_run(world: Any, task: Task, setup: Setup, seed: int, grid: Grid, out: str) -> Run:
    """One mpicrossbow run of ``setup`` at ``seed`` through a Session, stopping at the target."""
    from mpi4py import MPI

    from mpicrossbow.config import load_config
    from mpicrossbow.training.session import Session

    rule = dict(grid.rule_settings.get(setup.rule, {}))
    if setup.alpha:
        rule["alpha"] = alpha_value(setup.alpha, grid.ranks * setup.learners)
    pool: dict[str, Any] = {"learners": setup.learners, "engine": setup.engine}
    if setup.tune:
        pool.update(learners="auto", tune=setup.tune, max_learners=grid.max_learners)
    extra = {
        "__top__": {
            "rule": setup.rule,
            "modelfile": task.modelfile,
            "modelclass": task.modelclass,
            "devices": "cpu",
        },
        "session": {
            "epochs": task.max_epochs,
            "seed": seed,
            "output": out,
            "progress": "off",
            "log_level": "warning",
            "threads": grid.threads,
            "validate_every": grid.validate_every,
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
            # the grid's rates are already scaled for k, except under a tuner that changes k
            "lr_scaling": "sqrt" if setup.tune else "none",
        },
        "data": {"dataset": task.dataset, "batch_size": setup.batch},
        "pool": pool,
        "rule": rule,
    }
    session = Session(load_config(extra=extra), world)
    session.prepare_local()
    session.prepare_collective()
    result = session.run()
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
                    print(
                        f"[{task.name} {n}/{len(todo)}] {setup.label} seed {seed}: "
                        + (f"{run.seconds:.2f} s, {run.epochs:.2f} epochs" if run.reached else "missed")
                        + f", {run.samples_per_s:,.0f} samples/s, final {run.final_accuracy:.4f} "
                        f"({time.perf_counter() - started:.1f} s)",
                        flush=True,
                    )
                    save_runs(runs, path)
    group.close()
    return runs


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


def table(task: Task, rows: list[Row]) -> str:
    """Every setup of a task, fastest to the target first."""
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
    for side in (DDP, XB):
        row = best[side]
        lines.append(
            f"- best {side}: "
            + (
                f"{row.setup.label}: {row.seconds:.2f} s ({row.epochs:.2f} epochs)"
                if row
                else "none reached it"
            )
        )
    if best[DDP] and best[XB]:
        lines.append(
            f"- best mpicrossbow ÷ best DDP time to target: **{best[XB].seconds / best[DDP].seconds:.2f}**"
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
        print("appended to", append_result("tta", "Time to accuracy: mpicrossbow against DDP", text))


def main() -> int:
    """Re-launch under mpiexec, train the grid, report on rank 0 (or only report, from tta-runs.json)."""
    args = parse_args(sys.argv[1:])
    grid = load_grid(args.grid, {k: getattr(args, k) for k in NARROWS if getattr(args, k)})
    if args.report_only:
        report(grid, load_runs(Path(args.runs)), args)
        return 0
    if not under_mpi():
        return relaunch(__spec__.name, grid.ranks, sys.argv[1:], timeout_s=args.timeout)
    from mpicrossbow.launch.world import detect_world
    from mpicrossbow.log import setup_logging

    world = detect_world()
    setup_logging(world.rank, world.size, logging.WARNING)
    runs = train_all(grid, world, Path(args.runs))
    if world.rank == 0:
        report(grid, runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
