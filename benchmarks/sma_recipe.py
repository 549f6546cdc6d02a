"""SMA's recipe on MNIST-1D: which elastic rate α, and which learning-rate scaling (``[optim] lr_scaling``),
reach the highest validation accuracy within the epoch cap, for k = 2 … 32 learners of batch 16.

    python -m benchmarks.sma_recipe            # both grids, 20 epochs, seed 0; results/sma_recipe.md
    python -m benchmarks.sma_recipe --epochs 40 --seeds 0,1,2 --no-write

The job is launch/mnist1d.cfg (the paper's CNN) on 2 ranks with ``pool.engine = fused``, m learners per rank
(k = 2m) of batch 16, momentum 0.9 for the learners and for z, weight decay 5e-4, a 2-epoch warm-up and the
cfg's multistep decay moved to 60 % and 85 % of the run. The base rate η₀ = 0.025 is the cfg's 0.1 (for
BSP's global batch 2 × 32 = 64) scaled to one learner's batch of 16.

- **α grid**: α ∈ {1/k, 0.1, 0.2, 2/k} at ``lr_scaling = sqrt`` (η = η₀√k: 0.1 at k = 16, Crossbow's rate
  at batch 16). An α at or past the stability bound 2(1+μ)/(k+1+μ) is refused by SMA and shown as such.
- **lr_scaling grid**: none, sqrt and linear from η₀, α left at SMA's default.

Each k is one ``mpiexec`` job whose runs go one after another (tests/mpi_scripts/cfg_runs.py: torch starts
once per rank), through ``crossbow-launch``'s own code path. ``session.on_nan = skip`` lets a diverging run
finish (with chance accuracy) instead of ending the job. One seed's final accuracy moves by about a point
from one trajectory to the next, so differences of a point or two within one seed are noise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

from benchmarks.report import append_result, cfg_runs
from mpicrossbow.rules.sma_stability import alpha_bound, default_alpha
from mpicrossbow.training.run.schedule import lr_scale

CFG = "launch/mnist1d.cfg"
RANKS = 2
#: One learner's batch in the small-learner recipe.
BATCH = 16
#: One learner's base rate: the cfg's 0.1 for a global batch of 64, scaled to a batch of 16.
BASE_LR = 0.025
MOMENTUM = 0.9
#: The cfg's own MNIST-1D recipe as benchmarks/links.py trains it (batch 32, lr 0.1 as written): the decay at
#: epoch 20 of its 30, a 2-epoch warm-up; benchmarks/epochs_to_target.py's ``--recipe cfg`` too.
CFG_RECIPE = ("DEVICES=cpu", "optim.milestones=20", "optim.warmup_epochs=2")
ALPHAS = ("1/k", "0.1", "0.2", "2/k")
SCALINGS = ("none", "sqrt", "linear")


def alpha_value(name: str, k: int) -> float:
    """α named ``name`` (``1/k``, ``2/k`` or a number) for ``k`` learners."""
    return {"1/k": 1.0 / k, "2/k": 2.0 / k}.get(name) or float(name)


def recipe(epochs: int) -> list[str]:
    """The MNIST-1D small-learner recipe (module docstring) for ``epochs`` epochs, whatever the rule: fused
    learners of batch 16 at η₀ = BASE_LR with momentum, a 2-epoch warm-up, decays at 60 % and 85 % of the
    epochs; benchmarks/epochs_to_target.py runs every rule on it."""
    first, second = max(1, round(0.6 * epochs)), max(2, round(0.85 * epochs))
    return [
        "DEVICES=cpu",
        "pool.engine=fused",
        f"data.batch_size={BATCH}",
        f"optim.lr={BASE_LR}",
        f"optim.momentum={MOMENTUM}",
        "optim.warmup_epochs=2",
        f"optim.milestones={first},{second}",
        f"session.epochs={epochs}",
        "session.on_nan=skip",
    ]


def common(epochs: int) -> list[str]:
    """The overrides every run takes: SMA on :func:`recipe`, z's momentum μ = MOMENTUM, no validation
    before the end."""
    return [*recipe(epochs), "RULE=SMA", f"rule.momentum={MOMENTUM}", "session.validate_every=0"]


def train(out: Path, k: int, runs: dict[str, str], epochs: int, timeout_s: float) -> dict[str, float]:
    """Train every run of ``runs`` (label → comma-separated overrides) with k learners in one MPI job;
    label → final validation accuracy."""
    learners = k // RANKS
    specs = [f"{label}={CFG},pool.learners={learners},{overrides}" for label, overrides in runs.items()]
    return cfg_runs(out / f"k{k}", RANKS, specs, common(epochs), timeout_s, f"k = {k}")


def mean(values: list[float]) -> float:
    """Their mean."""
    return sum(values) / len(values)


def alpha_grid(out: Path, ks: list[int], seeds: list[int], epochs: int) -> str:
    """The α table: one row per k, one column per α (mean final accuracy over ``seeds``)."""
    rows = [
        "| k | bound | " + " | ".join(f"α = {a}" for a in ALPHAS) + " |",
        "|---|---|" + "---|" * len(ALPHAS),
    ]
    for k in ks:
        bound = alpha_bound(k, MOMENTUM)
        runs = {
            f"{name}@{seed}": f"optim.lr_scaling=sqrt,optim.lr_cap=100,rule.alpha={alpha_value(name, k)!r},"
            f"session.seed={seed}"
            for name in ALPHAS
            if alpha_value(name, k) < bound
            for seed in seeds
        }
        found = train(out / "alpha", k, runs, epochs, timeout_s=300 * len(runs))
        cells = []
        for name in ALPHAS:
            got = [found[f"{name}@{seed}"] for seed in seeds if f"{name}@{seed}" in found]
            value = alpha_value(name, k)
            cells.append(f"{mean(got):.3f} (α {value:.3g})" if got else f"past bound (α {value:.3g})")
        rows.append(f"| {k} | {bound:.3f} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def scaling_grid(out: Path, ks: list[int], seeds: list[int], epochs: int) -> str:
    """The lr_scaling table: one row per k, one column per scaling, α at SMA's default."""
    rows = ["| k | default α | " + " | ".join(SCALINGS) + " |", "|---|---|" + "---|" * len(SCALINGS)]
    for k in ks:
        runs = {
            # uncapped, knowingly (lr_cap 100): this grid measures the trap a cap avoids
            f"{scaling}@{seed}": f"optim.lr_scaling={scaling},optim.lr_cap=100,session.seed={seed}"
            for scaling in SCALINGS
            for seed in seeds
        }
        found = train(out / "scaling", k, runs, epochs, timeout_s=300 * len(runs))
        cells = [
            f"{mean([found[f'{s}@{seed}'] for seed in seeds]):.3f} (η {BASE_LR * lr_scale(s, k):.3g})"
            for s in SCALINGS
        ]
        rows.append(f"| {k} | {default_alpha(k, MOMENTUM):.3g} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    """Measure both grids, print them, append them to results/sma_recipe.md unless ``--no-write``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20, help="epochs of every run (the cap)")
    parser.add_argument("--seeds", default="0", help="comma-separated session.seed values to average")
    parser.add_argument("--alpha-ks", default="2,4,8,16,32", help="k of the α grid (even: 2 ranks)")
    parser.add_argument("--scaling-ks", default="4,8,16,32", help="k of the lr_scaling grid")
    parser.add_argument("--grids", default="alpha,scaling", help="comma-separated: alpha, scaling")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    grids = args.grids.split(",")
    tables = []
    with TemporaryDirectory(prefix="sma-recipe-") as tmp:
        if "alpha" in grids:
            ks = [int(k) for k in args.alpha_ks.split(",")]
            tables.append(("SMA's α", alpha_grid(Path(tmp), ks, seeds, args.epochs)))
        if "scaling" in grids:
            ks = [int(k) for k in args.scaling_ks.split(",")]
            tables.append(("lr_scaling for SMA", scaling_grid(Path(tmp), ks, seeds, args.epochs)))
    for title, text in tables:
        print(f"{title}\n{text}")
        if not args.no_write:
            notes = (
                f"MNIST-1D CNN, {RANKS} ranks × k/{RANKS} fused learners of batch 16, {args.epochs} epochs, "
                f"seeds {args.seeds}: final validation accuracy (mean over seeds). Base rate η₀ = {BASE_LR}; "
                "the α grid runs at lr_scaling = sqrt; the lr_scaling grid at SMA's default α. See the "
                "module docstring for the whole recipe."
            )
            append_result("sma_recipe", title, text, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
