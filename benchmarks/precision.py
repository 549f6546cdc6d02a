"""Every rule trained in fp32 and in bf16 (``[optim] precision``) on the digits MLP and the MNIST-1D CNN:
the final validation accuracy of each, and the difference in points.

    python -m benchmarks.precision                      # the whole grid, seeds 0-2; results/precision.md
    python -m benchmarks.precision --datasets digits --seeds 0 --no-write

Each world size is one ``mpiexec`` job whose runs go one after another, every fp32 run then every bf16 one
(tests/mpi_scripts/cfg_runs.py: torch starts once per rank), through ``crossbow-launch``'s own code path.
The synchronous rules run on 2 ranks, the asynchronous and parameter-server rules on 4 (their existing digits
tests' settings, tests/test_compression_mpi.py); the cfgs are launch/digits.cfg and launch/mnist1d.cfg as
they are (MNIST-1D's DEVICES widened to any rank count; ASGD and DiLoCo, which diverge there in fp32 with
the cfg's recipe, with :data:`TUNED`'s settings). bf16 autocast runs on the CPU, so this measures on the
machine at hand what a GPU user's bf16 costs in accuracy.

One seed's accuracy moves by about a point from one training trajectory to the next (MNIST-1D's cfg: 95.6 /
96.1 / 96.1 % over three seeds), and an asynchronous rule's run differs from the next with the timing of its
messages; so the grid is run for several seeds (``session.seed``) and compares the means.
tests/test_precision_mpi.py asserts the synchronous rules on seed 0: the digits within :data:`TOLERANCE`,
MNIST-1D's BSP within one trajectory's spread (bf16 runs on the CPU's own bf16 units where it has them, so
its trajectory differs from one CPU to the next).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from benchmarks.report import REPO, append_result, cfg_runs

sys.path.insert(0, str(REPO / "tests"))  # the digits tests' rule table
from digits_rules import DIGITS_RULES

#: The largest difference in final validation accuracy (a fraction: 0.01 = 1 point) bf16 may show.
TOLERANCE = 0.01
#: cfg file of each data set, with the overrides every run of it takes.
DATASETS = {
    "digits": ("launch/digits.cfg", ()),
    "mnist1d": ("launch/mnist1d.cfg", ("DEVICES=cpu",)),
}
#: ranks → {label: overrides}: every rule, with the settings of its existing digits tests.
RULES = {2: {**DIGITS_RULES[2], "SMA": "RULE=SMA,pool.learners=2"}, 4: DIGITS_RULES[4]}
#: data set → {rule label: overrides} where the cfg's recipe does not train that rule (in fp32 either).
TUNED = {"mnist1d": {"ASGD": "rule.scale=0", "DILOCO": "rule.outer_lr=0.3"}}
#: The rules whose ranks move in lock-step: their runs are deterministic, so fp32 against bf16 differ by
#: the arithmetic alone (the others also by the timing of their messages).
SYNCHRONOUS = ("BSP", "SMA", "EASGD-sync", "LOCALSGD-hier-m2", "DILOCO")


@dataclass(frozen=True)
class Outcome:
    """One rule on one data set: the final validation accuracy in fp32 and in bf16 (means over seeds)."""

    dataset: str
    rule: str
    fp32: float
    bf16: float
    seeds: int = 1

    @property
    def points(self) -> float:
        """bf16 minus fp32, in points of accuracy."""
        return 100 * (self.bf16 - self.fp32)


def accuracies(
    out: Path,
    ranks: int,
    labels: dict[str, str],
    dataset: str,
    precisions: tuple[str, ...],
    seeds: list[int],
    timeout_s: float,
) -> dict[tuple[str, str], float]:
    """Train every rule of ``labels`` (label → overrides) on ``ranks`` ranks on ``dataset`` in every one of
    ``precisions`` for every seed, in one MPI job (torch starts once per rank for all of them); (label,
    precision) → mean accuracy over the seeds."""
    cfg, common = DATASETS[dataset]
    tuned = TUNED.get(dataset, {})
    runs = [
        f"{label}@{seed}@{precision}={cfg},{overrides},session.seed={seed},optim.precision={precision}"
        + (f",{tuned[label]}" if label in tuned else "")
        for precision in precisions
        for label, overrides in labels.items()
        for seed in seeds
    ]
    what = f"{dataset} {'/'.join(precisions)} on {ranks} ranks"
    ran = cfg_runs(out / f"{dataset}-{ranks}", ranks, runs, common, timeout_s, what)
    found: dict[tuple[str, str], list[float]] = {}
    for run, accuracy in ran.items():
        label, _, rest = run.partition("@")
        found.setdefault((label, rest.rpartition("@")[2]), []).append(accuracy)
    return {key: sum(values) / len(values) for key, values in found.items()}


def measure(
    out: Path,
    datasets: list[str],
    seeds: list[int] | None = None,
    rules: dict[int, dict[str, str]] | None = None,
    timeout_s: float = 600,
) -> list[Outcome]:
    """Every rule of ``rules`` (default: :data:`RULES`) on every data set of ``datasets`` in fp32 and bf16,
    the mean over ``seeds`` (default: seed 0), training under ``out``."""
    seeds, rules = seeds or [0], rules or RULES
    outcomes = []
    for dataset in datasets:
        for ranks, labels in rules.items():
            if not labels:
                continue
            found = accuracies(out, ranks, labels, dataset, ("fp32", "bf16"), seeds, timeout_s)
            outcomes += [
                Outcome(dataset, label, found[label, "fp32"], found[label, "bf16"], len(seeds))
                for label in labels
            ]
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """The results as a markdown table, one row per rule and data set."""
    rows = [
        "| data set | rule | ranks | seeds | fp32 | bf16 | bf16 − fp32 (points) |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        ranks = next(r for r, rules in RULES.items() if o.rule in rules)
        flag = "" if abs(o.points) <= 100 * TOLERANCE else " **over 1 point**"
        rows.append(
            f"| {o.dataset} | {o.rule} | {ranks} | {o.seeds} | {o.fp32:.4f} | {o.bf16:.4f} | "
            f"{o.points:+.2f}{flag} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    """Measure, print the table, append it to results/precision.md unless ``--no-write``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--datasets", default="digits,mnist1d", help="comma-separated: digits, mnist1d")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated session.seed values to average")
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes whose rules to run")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    with TemporaryDirectory(prefix="precision-") as tmp:
        seeds = [int(seed) for seed in args.seeds.split(",")]
        rules = {int(r): RULES[int(r)] for r in args.ranks.split(",")}
        outcomes = measure(Path(tmp), args.datasets.split(","), seeds, rules, timeout_s=600 * len(seeds))
    text = table(outcomes)
    print(text)
    if not args.no_write:
        worst = max(abs(o.points) for o in outcomes)
        notes = (
            f"Mean final validation accuracy over seeds {args.seeds}. "
            f"Largest difference: {worst:.2f} points (tolerance {100 * TOLERANCE:.0f}). Synchronous rules "
            f"({', '.join(SYNCHRONOUS)}) are deterministic on one machine, but bf16 runs on the CPU's own "
            "bf16 units where it has them, so one seed's bf16 trajectory differs from one CPU to the next "
            "and from fp32's as another seed's would; the others' runs also vary with the timing of their "
            "messages from one run to the next."
        )
        append_result("precision", "bf16 against fp32, every rule", text, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
