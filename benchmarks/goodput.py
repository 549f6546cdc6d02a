"""Time to a target accuracy with the learner auto-tuner: ``[pool] tune = goodput`` against ``tune =
throughput`` and fixed learner counts, on MNIST-1D under SMA.

    python -m benchmarks.goodput                          # seeds 0,1,2, to 94 %, cap 50 epochs
    python -m benchmarks.goodput --seeds 0 --no-write     # one seed, print only

It takes about a minute per seed on 2 CPU cores.

The job is launch/mnist1d.cfg (the paper's CNN) on 2 ranks with RULE=SMA, ``pool.engine = fused``, m learners
per rank of batch 16 (k = 2m), SMA's default α, the base rate η₀ = 0.025 (the cfg's 0.1 for a global batch of
64, scaled to one learner's batch of 16) scaled by ``[optim] lr_scaling`` (default linear: the best scaling
for k = 4 and 8 in results/sma_recipe.md) up to ``[optim] lr_cap`` (default 0.2: one learner of batch 16
diverged at 0.4), the cfg's schedule (lr decays at epochs 30 and 42), a validation
every epoch and ``[session] target_accuracy``. Each configuration trains until the target is reached or the
epoch cap is hit; the run's ``target_seconds`` (training seconds, validations left out, metrics.h5 attribute)
is the figure, NaN where not reached. The configurations are ``learners = auto`` with tune = goodput and
tune = throughput (``max_learners`` 8, threshold 0.1) and fixed m ∈ {1, 2, 3, 4, 8}. Each seed is one
``mpiexec`` job whose runs go one after another (tests/mpi_scripts/cfg_runs.py: torch starts once per
rank), through ``crossbow-launch``'s own code path; ``session.on_nan = skip`` lets a diverging run end
at its cap.

Why SMA: it is Crossbow's rule, the one the tuner was made for, and its rate follows k with lr_scaling. Its
B_noise is the spread of the learners' gradients on one rank (noise_scale.py), which counts the replicas'
drift as noise too: an over-estimate of B_noise, so the goodput tuner's efficiency is optimistic, never
pessimistic. With one learner per rank B_noise is unknown and both tuners take the second learner alike.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

from benchmarks.report import append_result, cfg_runs
from mpicrossbow.training.reporting.metrics import read_metrics

log = logging.getLogger("benchmarks.goodput")

CFG = "launch/mnist1d.cfg"
RANKS = 2
#: One learner's base rate: the cfg's 0.1 for a global batch of 64, scaled to a batch of 16.
BASE_LR = 0.025
#: label → the overrides of that configuration.
CONFIGS = {
    "goodput": "pool.learners=auto,pool.tune=goodput",
    "throughput": "pool.learners=auto,pool.tune=throughput",
    "m1": "pool.learners=1",
    "m2": "pool.learners=2",
    "m3": "pool.learners=3",
    "m4": "pool.learners=4",
    "m8": "pool.learners=8",
}


def common(epochs: int, target: float, scaling: str, cap: float) -> list[str]:
    """The overrides every run takes (module docstring)."""
    return [
        "DEVICES=cpu",
        "RULE=SMA",
        "pool.engine=fused",
        "pool.max_learners=8",
        "pool.tune_threshold=0.1",
        "data.batch_size=16",
        f"optim.lr={BASE_LR}",
        f"optim.lr_scaling={scaling}",
        f"optim.lr_cap={cap}",
        f"session.epochs={epochs}",
        "session.validate_every=1",
        f"session.target_accuracy={target}",
        "session.on_nan=skip",
    ]


def one_seed(out: Path, seed: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every configuration with ``seed`` in one MPI job; label → target seconds and epochs, final learners,
    final accuracy. The job's first run pays the process's one-time costs (allocator, caches), so the order
    turns by one configuration per seed: no configuration is always first."""
    labels = list(CONFIGS)
    turn = seed % len(labels)
    labels = labels[turn:] + labels[:turn]
    specs = [f"{label}={CFG},{CONFIGS[label]},session.seed={seed}" for label in labels]
    folder = out / f"seed{seed}"
    shared = common(args.epochs, args.target, args.lr_scaling, args.lr_cap)
    cfg_runs(folder, RANKS, specs, shared, args.timeout, f"seed {seed}")
    found = {}
    for label in CONFIGS:
        (run,) = (folder / label).iterdir()
        attrs = read_metrics(run / "metrics.h5")["attrs"]
        found[label] = {
            "seconds": float(attrs["target_seconds"]),
            "epochs": float(attrs["target_epochs"]),
            "learners": float(attrs["learners"]),
            "accuracy": float(attrs["val_accuracy"]),
        }
        log.info("seed %d %s: %s", seed, label, found[label])
    return found


def median(values: list[float]) -> float:
    """The median, a run that missed the target (NaN) counting as the slowest."""
    return statistics.median([math.inf if math.isnan(v) else v for v in values])


def shown(value: float, unit: str = "") -> str:
    """A figure for the table: '—' for a missed target."""
    return "—" if not math.isfinite(value) else f"{value:.1f}{unit}"


def table(results: dict[int, dict[str, dict[str, float]]]) -> tuple[str, str]:
    """The markdown table (one row per configuration) and the acceptance verdict."""
    seeds = sorted(results)
    rows = [
        "| run | median s to target | per seed (s) | median epochs | final m per seed | final acc |",
        "|---|---|---|---|---|---|",
    ]
    medians = {}
    for label in CONFIGS:
        runs = [results[seed][label] for seed in seeds]
        medians[label] = median([r["seconds"] for r in runs])
        rows.append(
            f"| {label} | {shown(medians[label])} | {', '.join(shown(r['seconds']) for r in runs)} | "
            f"{shown(median([r['epochs'] for r in runs]))} | "
            f"{', '.join(str(int(r['learners'])) for r in runs)} | "
            f"{statistics.median(r['accuracy'] for r in runs):.3f} |"
        )
    best = min((label for label in CONFIGS if label.startswith("m")), key=lambda label: medians[label])
    ratio = medians["goodput"] / medians[best] if math.isfinite(medians[best]) else math.nan
    verdict = (
        f"goodput auto / best fixed ({best}): {ratio:.2f} (wanted ≤ 1.1: {'yes' if ratio <= 1.1 else 'no'}); "
        f"goodput auto sooner than throughput auto: "
        f"{'yes' if medians['goodput'] < medians['throughput'] else 'no'} "
        f"({shown(medians['goodput'], ' s')} vs {shown(medians['throughput'], ' s')})"
    )
    return "\n".join(rows), verdict


def main(argv: list[str]) -> int:
    """Measure every configuration for every seed, print the table, append it to results/goodput.md unless
    ``--no-write``."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated session.seed values")
    parser.add_argument("--epochs", type=int, default=50, help="the epoch cap of every run")
    parser.add_argument("--target", type=float, default=0.94, help="[session] target_accuracy")
    parser.add_argument("--lr-scaling", default="linear", help="[optim] lr_scaling: none, sqrt, linear")
    parser.add_argument(
        "--lr-cap", type=float, default=0.2, help="[optim] lr_cap: the scaled rate's cap (SMA refuses 0)"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one seed's job may take")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    with TemporaryDirectory(prefix="goodput-") as tmp:
        results = {seed: one_seed(Path(tmp), seed, args) for seed in seeds}
    text, verdict = table(results)
    log.info("%s\n\n%s", text, verdict)
    if not args.no_write:
        notes = (
            f"MNIST-1D CNN under SMA, {RANKS} ranks × m fused learners of batch 16, η₀ = {BASE_LR} with "
            f"lr_scaling = {args.lr_scaling} up to lr_cap {args.lr_cap:g}, target validation accuracy "
            f"{args.target}, cap {args.epochs} "
            f"epochs, seeds {args.seeds}: training seconds (validations left out) to the first validation at "
            f"the target; '—' not reached (counted as slowest in the median). {verdict}."
        )
        append_result("goodput", f"Goodput vs throughput tuner, target {args.target}", text, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
