"""Every rule on the same real task, side by side: the digits job (launch/digits.cfg) at 2 and 4 ranks.

For each rule and world size it runs ``crossbow-launch`` under ``mpiexec`` and reads the run's metrics.h5:
epochs and wall time until the validated model first reaches the target accuracy, the final accuracy, and
the share of training time spent in the rule's exchanges. A second table slows one rank on purpose
(``session.slow_ranks``) and compares the other training ranks' step rate with an unslowed run: the
asynchronous rules should keep their pace, BSP cannot. Writes ``benchmarks/results/rules.md`` and a PNG of
validation accuracy against wall time (one curve per rule).

    python -m benchmarks.rules [--target 0.95] [--sizes 2 4] [--slow-seconds 0.01]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.report import REPO, RESULTS, append_result

#: (label, overrides) of every rule configuration compared.
RULES: list[tuple[str, list[str]]] = [
    ("BSP gradient", ["RULE=BSP", "rule.mode=grad"]),
    ("BSP average", ["RULE=BSP", "rule.mode=avg"]),
    ("EASGD sync", ["RULE=EASGD"]),
    ("EASGD async", ["RULE=EASGD", "rule.mode=async"]),
    ("GOSGD", ["RULE=GOSGD"]),
    ("SMA", ["RULE=SMA"]),
]
#: Rules whose straggler tolerance is measured (asynchronous ones, and BSP for contrast).
STRAGGLER_RULES = ("BSP gradient", "EASGD async", "GOSGD")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=float, default=0.95, help="validation accuracy to reach")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="world sizes")
    parser.add_argument("--slow-seconds", type=float, default=0.01, help="sleep per step of the slowed rank")
    parser.add_argument("--straggler-size", type=int, default=4, help="world size of the straggler runs")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/")
    return parser.parse_args()


def launch(ranks: int, overrides: list[str], out: Path) -> dict | None:
    """Run the digits job; return its metrics (None if the rule is not available or the run failed)."""
    from mpicrossbow.training.reporting.metrics import read_metrics

    here = Path(sys.executable).parent
    cmd = [str(here / "mpiexec"), "-n", str(ranks), str(here / "crossbow-launch"), "-cfg",
           "launch/digits.cfg", f"session.output={out}", "session.progress=off", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"  failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return read_metrics(run / "metrics.h5")


def to_target(metrics: dict, target: float) -> tuple[float, float]:
    """(epoch, seconds) of the first validation at or above ``target``; NaN if never."""
    val = metrics["val"]
    hits = np.nonzero(val["accuracy"] >= target)[0]
    if not len(hits):
        return float("nan"), float("nan")
    return float(val["epoch"][hits[0]]), float(val["time"][hits[0]])


def main() -> int:
    args = parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for label, overrides in RULES:
                print(f"{label}, {size} ranks", flush=True)
                m = launch(size, overrides, Path(tmp) / f"{label}-{size}".replace(" ", "_"))
                if m is None:
                    rows.append(f"| {label} | {size} | – | – | failed | – |")
                    continue
                epoch, seconds = to_target(m, args.target)
                attrs = m["attrs"]
                share = statistics.median(s for s in attrs["rank_exchange_share"] if s == s)  # NaN: server
                final = attrs["val_accuracy"]
                rows.append(f"| {label} | {size} | {epoch:.3g} | {seconds:.2f} | {final:.4f} | {share:.0%} |")
                curves[(label, size)] = (m["val"]["time"], m["val"]["accuracy"])
        slow_rows = []
        n = args.straggler_size
        for label, overrides in RULES:
            if label not in STRAGGLER_RULES:
                continue
            rates = {}
            for slowed in (False, True):
                extra = (
                    [f"session.slow_ranks={n - 1}", f"session.slow_seconds={args.slow_seconds}"]
                    if slowed
                    else []
                )
                print(f"{label}, {n} ranks, slowed={slowed}", flush=True)
                m = launch(n, [*overrides, *extra], Path(tmp) / f"slow-{label}-{slowed}".replace(" ", "_"))
                if m is None:
                    break
                per_rank = list(m["attrs"]["rank_steps_per_second"])[: n - 1]  # every rank but the slowed one
                rates[slowed] = statistics.median(r for r in per_rank if r == r)  # NaN: a serving rank
            if len(rates) == 2:
                slow_rows.append(
                    f"| {label} | {rates[False]:.0f} | {rates[True]:.0f} | {rates[True] / rates[False]:.2f} |"
                )
            else:
                slow_rows.append(f"| {label} | – | – | failed |")

    table = "\n".join([
        f"Digits job (launch/digits.cfg: MLP, 20 epochs, batch 16 per rank), target validation accuracy "
        f"{args.target:.0%}; time is wall time of the run when the validated model first reached it; "
        "exchange share: median over the training ranks.",
        "",
        "| rule | ranks | epochs to target | seconds to target | final val accuracy | exchange share |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"One of {n} ranks (rank {n - 1}) sleeps {args.slow_seconds * 1e3:.0f} ms after every step; median "
        "step rate of the other training ranks (steps/s):",
        "",
        "| rule | unslowed | one rank slowed | slowed ÷ unslowed |",
        "|---|---:|---:|---:|",
        *slow_rows,
    ])  # fmt: skip
    print(table)
    fig, axes = plt.subplots(1, len(args.sizes), figsize=(6 * len(args.sizes), 4), sharey=True, squeeze=False)
    for ax, size in zip(axes[0], args.sizes, strict=True):
        for label, _ in RULES:
            if (label, size) in curves:
                t, acc = curves[(label, size)]
                ax.plot(t, acc, marker=".", label=label)
        ax.axhline(args.target, color="grey", linestyle=":", linewidth=1)
        ax.set(
            title=f"digits, {size} ranks",
            xlabel="wall time (s)",
            ylabel="validation accuracy",
            ylim=(0.5, 1.0),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        png = RESULTS / "rules.png"
        fig.savefig(png, dpi=110)
        print(
            "appended to",
            append_result("rules", "Every rule on the digits job", table + "\n\n![](rules.png)"),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
