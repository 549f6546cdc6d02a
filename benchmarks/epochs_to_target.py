"""Epochs to 94 % on MNIST-1D against k, the learners in all, for SMA, EASGD, LOCALSGD and BSP: does averaging
k small-batch learners need fewer epochs than one large batch?

    python -m benchmarks.epochs_to_target      # k = 4, 8, 16, seeds 0-2: results/epochs_to_target.md
    python -m benchmarks.epochs_to_target --ks 8 --seeds 0 --no-write
    python -m benchmarks.epochs_to_target --configs "period 4,period 16"   # some rows only
    python -m benchmarks.epochs_to_target --configs "BSP,SMA (lin,LOCALSGD (lin" --targets 0.8,0.85,0.9,0.94

With ``--targets`` (several accuracies), every run trains to the highest and the epochs to each lower one are
read from the same runs' validations (the first at or above it; metrics.h5 keeps one at each epoch's end, so
to the whole epoch): one table per target, and a table of each rule's epochs relative to BSP's, per target
and k — what ``RULE = AUTO``'s statistical side (mpicrossbow/rules/rule_choice.py, EPOCHS_VS_BSP) would read
were it told the target.

The job is launch/mnist1d.cfg (the paper's CNN) on 2 ranks with ``pool.engine = fused``, k/2 learners per rank
of batch 16, η₀ = 0.025 (the cfg's 0.1 for a global batch of 64, scaled to one learner's 16), momentum 0.9,
a 2-epoch warm-up, the decay at 60 % and 85 % of the epoch cap (default 100), a validation every quarter
epoch and ``[session] target_accuracy = 0.94`` (training stops there; metrics.h5 keeps the epochs to it).
Each rule runs with the documented learning-rate rule (docs/rules.md, "The learning rate with many
learners"): ``lr_scaling = linear`` up to ``lr_cap = 0.2``, the largest rate one learner of batch 16 trains
at here (0.4 diverged) — k·η₀ for k ≤ 8, 0.2 beyond — at each rule's default α/τ/period (LOCALSGD also at
periods 4 and 16, the other periods ``RULE = AUTO`` chooses among); BSP's linear rule
for its global batch of 16·k is the same rate. SMA also runs with ``sqrt``, the rule before the cap existed.
A run that misses the target within the cap counts as missing; the table shows the median epochs of the
seeds that reached it and how many did.

``--task digits`` (with ``--recipe cfg``) runs launch/digits.cfg's MLP instead, at its batch 16 and lr 0.05 as
written, as benchmarks/links.py trains it: a second model beside the one ``RULE = AUTO``'s table comes from.

Each run also gives its gradient noise scale: the median of its train rows' ``noise_scale`` (B_noise in
samples, every 10th step, :mod:`mpicrossbow.training.tuning.noise_scale`) up to the epoch it reached the
highest target, one table of each row's median over the seeds, with B_noise/b, the learners' batches in it.
BSP's is the gradient's (its learners' mean over all k); under an averaging rule the learners' gradients are
taken at replicas apart, so its figure also counts their spread (not measured with one learner a rank).

Each k is one ``mpiexec`` job (tests/mpi_scripts/cfg_runs.py: its runs one after another through
``crossbow-launch``'s own code path).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from tempfile import TemporaryDirectory

from benchmarks.report import append_result, cfg_runs
from benchmarks.sma_recipe import BATCH, CFG_RECIPE, recipe
from mpicrossbow.training.reporting.metrics import read_metrics

CFG = "launch/mnist1d.cfg"
#: task → (cfg, its batch as written); digits only with the cfg's own recipe (``--recipe cfg``).
TASKS = {"mnist1d": (CFG, 32), "digits": ("launch/digits.cfg", 16)}
RANKS = 2
TARGET = 0.94
#: The most one learner of batch 16 is given: 0.4 diverged on MNIST-1D (results/sma_recipe.md).
LR_CAP = 0.2
#: The documented learning-rate rule for many learners.
LINEAR = f"optim.lr_scaling=linear,optim.lr_cap={LR_CAP}"
#: label → the rule and its learning-rate rule.
CONFIGS = {
    "SMA (linear ≤ 0.2)": f"RULE=SMA,optim.lr_scaling=linear,optim.lr_cap={LR_CAP}",
    "SMA (sqrt)": "RULE=SMA,optim.lr_scaling=sqrt,optim.lr_cap=100",  # uncapped, knowingly
    "EASGD (linear ≤ 0.2)": f"RULE=EASGD,optim.lr_scaling=linear,optim.lr_cap={LR_CAP}",
    "LOCALSGD (linear ≤ 0.2)": f"RULE=LOCALSGD,optim.lr_scaling=linear,optim.lr_cap={LR_CAP}",
    "LOCALSGD period 4 (linear ≤ 0.2)": f"RULE=LOCALSGD,rule.period=4,{LINEAR}",
    "LOCALSGD period 16 (linear ≤ 0.2)": f"RULE=LOCALSGD,rule.period=16,{LINEAR}",
    "BSP (linear ≤ 0.2)": f"RULE=BSP,optim.lr_scaling=linear,optim.lr_cap={LR_CAP}",
}


def common(
    epochs: int, target: float = TARGET, recipe_name: str = "small-learners", task: str = "mnist1d"
) -> list[str]:
    """The overrides every run takes: the small-learner recipe capped at ``epochs`` (the module docstring)
    or the cfg's own (MNIST-1D: :data:`~benchmarks.sma_recipe.CFG_RECIPE`; digits: its cfg as written),
    fused, a validation every quarter epoch and the target it stops at."""
    if recipe_name == "small-learners":
        base = recipe(epochs)
    else:
        own = list(CFG_RECIPE) if task == "mnist1d" else ["DEVICES=cpu"]
        base = [*own, "pool.engine=fused", f"session.epochs={epochs}"]
    return [*base, "session.validate_every=0.25", f"session.target_accuracy={target}"]


def as_written(configs: dict[str, str]) -> dict[str, str]:
    """``configs`` with their learning-rate rule taken out (the cfg's ``lr`` as written), relabelled."""
    out = {}
    for label, spec in configs.items():
        kept = [
            part for part in spec.split(",") if not part.startswith(("optim.lr_scaling=", "optim.lr_cap="))
        ]
        out[label.split(" (")[0] + " (lr as written)"] = ",".join(kept)
    return out


def epochs_to_target(
    out: Path,
    k: int,
    seeds: list[int],
    epochs: int,
    configs: dict[str, str],
    targets: list[float],
    recipe_name: str = "small-learners",
    task: str = "mnist1d",
) -> tuple[dict[float, dict[str, list[float]]], dict[str, list[float]]]:
    """Every configuration of ``configs`` (label → overrides) at ``k`` learners for every seed (one MPI job),
    trained to the highest of ``targets``: target → label → epochs to it of each seed (NaN: missed within the
    cap), and label → each seed's gradient noise scale (:func:`run_noise_scale`)."""
    specs = {
        f"c{i}s{seed}": f"{TASKS[task][0]},pool.learners={k // RANKS},{overrides},session.seed={seed}"
        for i, overrides in enumerate(configs.values())
        for seed in seeds
    }
    folder = out / f"k{k}"
    runs = [f"{label}={spec}" for label, spec in specs.items()]
    overrides = common(epochs, max(targets), recipe_name, task)
    cfg_runs(folder, RANKS, runs, overrides, 120 * len(specs) + 300, f"k = {k}")
    found: dict[float, dict[str, list[float]]] = {t: {label: [] for label in configs} for t in targets}
    noise: dict[str, list[float]] = {label: [] for label in configs}
    for i, label in enumerate(configs):
        for seed in seeds:
            (run,) = (folder / f"c{i}s{seed}").iterdir()
            metrics = read_metrics(run / "metrics.h5")
            epochs_done = fractional_epochs(metrics["val"]["step"], metrics["train"]["step"])
            for target in targets:
                found[target][label].append(first_at(epochs_done, metrics["val"]["accuracy"], target))
            noise[label].append(run_noise_scale(metrics["train"]["noise_scale"]))
    return found, noise


def run_noise_scale(values: Sequence[float]) -> float:
    """A run's gradient noise scale: the median of its train rows' B_noise (one per whole epoch, each the
    smoothed estimate at that epoch's end) that were measured (NaN: none was)."""
    measured = [float(v) for v in values if math.isfinite(float(v))]
    return statistics.median(measured) if measured else math.nan


def fractional_epochs(val_steps: Sequence[float], train_steps: Sequence[float]) -> list[float]:
    """Each validation's epochs done, fractional (metrics.h5's ``val`` rows carry the epoch's index): its
    step over the steps of an epoch, the first ``train`` row's step (one row per whole epoch). A run that
    ended within its first epoch has no such row: NaN for each."""
    per_epoch = float(train_steps[0]) if len(train_steps) else math.nan
    return [float(s) / per_epoch for s in val_steps]


def first_at(epochs: Sequence[float], accuracy: Sequence[float], target: float) -> float:
    """The epochs done at the first validation at or above ``target`` (NaN: none was)."""
    return next((float(e) for e, a in zip(epochs, accuracy, strict=True) if a >= target), math.nan)


def ratio_cell(values: list[float], bsp: list[float]) -> str:
    """Median epochs of the seeds that reached the target relative to BSP's (missed: none did)."""
    reached, base = [v for v in values if v == v], [v for v in bsp if v == v]
    if not reached or not base:
        return "missed"
    return f"{statistics.median(reached) / statistics.median(base):.2f}"


def cell(values: list[float]) -> str:
    """Median epochs of the seeds that reached the target, and how many did."""
    reached = [v for v in values if v == v]
    if not reached:
        return f"missed (0/{len(values)})"
    return f"{statistics.median(reached):.1f} ({len(reached)}/{len(values)})"


def tables(
    results: dict[int, dict[float, dict[str, list[float]]]], ks: list[int], targets: list[float]
) -> str:
    """One table of epochs per target, then (several targets, BSP among the rows) each rule's epochs
    relative to BSP's per target and k."""
    head = " | ".join(f"k = {k}" for k in ks)
    parts = []
    for target in targets:
        rows = [f"| rule (lr rule) | {head} |", "|---|" + "---|" * len(ks)]
        for label in results[ks[0]][target]:
            rows.append(f"| {label} | " + " | ".join(cell(results[k][target][label]) for k in ks) + " |")
        parts.append((f"**to {target:.0%}**\n\n" if len(targets) > 1 else "") + "\n".join(rows))
    bsp = next((label for label in results[ks[0]][targets[0]] if label.startswith("BSP")), None)
    if len(targets) > 1 and bsp is not None:
        rows = [f"| rule (lr rule), target | {head} |", "|---|" + "---|" * len(ks)]
        for label in results[ks[0]][targets[0]]:
            for target in targets if label != bsp else []:
                cells = (ratio_cell(results[k][target][label], results[k][target][bsp]) for k in ks)
                rows.append(f"| {label}, {target:.0%} | " + " | ".join(cells) + " |")
        parts.append("**epochs relative to BSP's**\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def noise_table(noise: dict[int, dict[str, list[float]]], ks: list[int], batch: int) -> str:
    """Each row's gradient noise scale at each k, the median over its seeds, in samples and in learners'
    batches of ``batch`` (B_noise/b). BSP's is the gradient's; under a model-averaging rule the learners'
    gradients are taken at replicas apart, and the estimate counts that spread as noise too."""
    head = " | ".join(f"k = {k}" for k in ks)
    rows = [f"| rule (lr rule) | {head} |", "|---|" + "---:|" * len(ks)]
    for label in noise[ks[0]]:
        cells = []
        for k in ks:
            measured = [v for v in noise[k][label] if math.isfinite(v)]
            value = statistics.median(measured) if measured else math.nan
            cells.append(f"{value:.0f} ({value / batch:.1f} b)" if measured else "not measured")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "**gradient noise scale B_noise** (median over epochs, then seeds)\n\n" + "\n".join(rows)


def main(argv: list[str]) -> int:
    """Measure, print the tables, append them to results/epochs_to_target.md unless ``--no-write``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ks", default="4,8,16", help="comma-separated learners in all (even: 2 ranks)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated session.seed values")
    parser.add_argument("--epochs", type=int, default=100, help="the epoch cap")
    parser.add_argument(
        "--configs",
        default="",
        help="comma-separated parts of the rows' labels to run (default: all), e.g. 'period 4,period 16'",
    )
    parser.add_argument(
        "--targets",
        default=str(TARGET),
        help="comma-separated validation accuracies (every run stops at the highest)",
    )
    parser.add_argument(
        "--recipe",
        choices=("small-learners", "cfg"),
        default="small-learners",
        help="small-learners: batch 16, each rule's rate scaled linearly to 0.2 (the documented recipe); "
        "cfg: launch/mnist1d.cfg's batch 32 and lr 0.1 as written, as benchmarks/links.py trains it",
    )
    parser.add_argument(
        "--task",
        choices=tuple(TASKS),
        default="mnist1d",
        help="mnist1d: launch/mnist1d.cfg's CNN; digits: launch/digits.cfg's MLP (with --recipe cfg only)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    if args.task == "digits" and args.recipe != "cfg":
        parser.error("--task digits: only with --recipe cfg (the small-learner recipe is MNIST-1D's)")
    ks, seeds = [int(k) for k in args.ks.split(",")], [int(s) for s in args.seeds.split(",")]
    targets = sorted(float(t) for t in args.targets.split(","))
    if not all(0 < t < 1 for t in targets):
        parser.error(f"--targets {args.targets}: accuracies between 0 and 1, e.g. 0.8,0.9,0.94")
    parts = [part.strip() for part in args.configs.split(",") if part.strip()]
    configs = {label: spec for label, spec in CONFIGS.items() if not parts or any(p in label for p in parts)}
    if not configs:
        parser.error(f"--configs {args.configs}: no row matches; the rows: {'; '.join(CONFIGS)}")
    if args.recipe == "cfg":
        configs = as_written({label: spec for label, spec in configs.items() if "sqrt" not in label})
    with TemporaryDirectory(prefix="epochs-to-target-") as tmp:
        measured = {
            k: epochs_to_target(Path(tmp), k, seeds, args.epochs, configs, targets, args.recipe, args.task)
            for k in ks
        }
    results = {k: found for k, (found, _) in measured.items()}
    batch = TASKS[args.task][1] if args.recipe == "cfg" else BATCH
    noise = noise_table({k: n for k, (_, n) in measured.items()}, ks, batch)
    text = tables(results, ks, targets) + "\n\n" + noise
    print(text)
    if not args.no_write:
        named = ", ".join(f"{t:.0%}" for t in targets)
        if args.task == "digits":
            job = (
                "digits MLP, 2 ranks × k/2 fused learners of launch/digits.cfg's batch 16 at its lr 0.05 as "
                "written (lr_scaling = none), its own schedule (benchmarks/links.py's recipe)"
            )
        elif args.recipe == "small-learners":
            job = (
                "MNIST-1D CNN, 2 ranks × k/2 fused learners of batch 16, η₀ = 0.025 scaled by each rule's "
                f"lr_scaling (linear: up to lr_cap {LR_CAP})"
            )
        else:
            job = (
                "MNIST-1D CNN, 2 ranks × k/2 fused learners of launch/mnist1d.cfg's batch 32 at its lr 0.1 "
                "as written (lr_scaling = none), the decay at epoch 20, a 2-epoch warm-up "
                "(benchmarks/links.py's recipe)"
            )
        notes = (
            f"Median epochs to {named} validation accuracy over the seeds that reached it within "
            f"{args.epochs} epochs (how many of seeds {args.seeds} did, in brackets); {job}"
            + f"; each run stops at {max(targets):.0%}"
            + (
                ", which is read to the quarter epoch; the lower targets to the whole epoch (metrics.h5 "
                "keeps the validation at each epoch's end and the one that stopped the run)."
                if len(targets) > 1
                else "."
            )
        )
        append_result("epochs_to_target", f"Epochs to {named} against k", text, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
