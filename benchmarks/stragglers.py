"""Stragglers: what one slow rank does to every rule — samples/s, time to accuracy, final accuracy.

Every rule runs the digits job (launch/digits.cfg) on 4 ranks three times: no rank slowed, rank 3 slowed 2×
and 4× (``session.slow_ranks=3 session.slow_factor=F``: rank 3 sleeps (F − 1) × each of its own steps). For
the parameter-server rules and async EASGD rank 0 serves, so the slowed rank is one of three workers.
Reports the aggregate training throughput (each training rank's own steps/s while it trained × its batch,
summed: an asynchronous job's wall time is set by its slowest worker finishing its epochs, so whole-job
samples/s would hide what the fast ranks do), the ratio to BSP under the same slowdown, epochs and seconds
until the validated model first reaches the target, and the final accuracy; then checks the issue's criterion:
with one rank slowed 2×, ASGD and SSP (s ≥ 2) keep ≥ 1.6× BSP's samples/s with final accuracy within one
point of BSP's. (The issue's second task, a CIFAR-sized ResNet-20 on synthetic data, is not in this script
yet: on 2 CPU cores one run takes many minutes.) Writes ``benchmarks/results/stragglers.md`` and a PNG.

    python benchmarks/stragglers.py [--factors 1 2 4] [--target 0.95] [--rules BSP ASGD ...]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import REPO, RESULTS, append_result

#: (label, overrides) of every rule compared.
RULES: list[tuple[str, list[str]]] = [
    ("BSP", ["RULE=BSP"]),
    ("SMA", ["RULE=SMA"]),
    ("EASGD sync", ["RULE=EASGD"]),
    ("EASGD async", ["RULE=EASGD", "rule.mode=async"]),
    ("GOSGD", ["RULE=GOSGD", "rule.p=0.05"]),
    ("ASGD", ["RULE=ASGD"]),
    ("SSP (s = 2)", ["RULE=SSP", "rule.staleness=2"]),
    ("PSGD", ["RULE=PSGD"]),
    ("WEEDOUT", ["RULE=WEEDOUT"]),
    ("LOCALSGD", ["RULE=LOCALSGD"]),
    ("DILOCO", ["RULE=DILOCO"]),
]
RANKS, SLOW_RANK = 4, 3
#: Samples per step of one rank (launch/digits.cfg: one learner, batch 16).
BATCH = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--factors", type=float, nargs="+", default=[1, 2, 4], help="slowdowns of rank 3")
    parser.add_argument("--target", type=float, default=0.95, help="validation accuracy to reach")
    parser.add_argument("--rules", nargs="+", help="labels to run (default all)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/")
    return parser.parse_args()


def launch(overrides: list[str], out: Path) -> dict:
    """One 4-rank run; its metrics."""
    from mpicrossbow.metrics import read_metrics

    here = Path(sys.executable).parent
    cmd = [str(here / "mpiexec"), "-n", str(RANKS), str(here / "crossbow-launch"), "-cfg",
           "launch/digits.cfg", f"session.output={out}", "session.progress=off", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return read_metrics(run / "metrics.h5")


def to_target(metrics: dict, target: float) -> tuple[float, float]:
    """(epoch, seconds) of the first validation at or above ``target``; NaN if never."""
    val = metrics["val"]
    hits = np.nonzero(val["accuracy"] >= target)[0]
    if not len(hits):
        return math.nan, math.nan
    return float(val["epoch"][hits[0]]), float(val["time"][hits[0]])


def main() -> None:
    args = parse_args()
    wanted = [r for r in RULES if args.rules is None or r[0] in args.rules]
    results: dict[tuple[str, float], dict] = {}
    for factor in args.factors:
        for label, overrides in wanted:
            slow = (
                [f"session.slow_ranks={SLOW_RANK}", f"session.slow_factor={factor:g}"] if factor > 1 else []
            )
            with tempfile.TemporaryDirectory() as tmp:
                metrics = launch([*overrides, *slow], Path(tmp))
            epoch, seconds = to_target(metrics, args.target)
            rates = [r for r in metrics["attrs"]["rank_steps_per_second"] if r == r]  # NaN: a server rank
            results[label, factor] = {
                "rate": BATCH * float(sum(rates)),
                "epoch": epoch,
                "seconds": seconds,
                "final": float(metrics["val"]["accuracy"][-1]),
                "curve": (metrics["val"]["time"], metrics["val"]["accuracy"]),
            }
            print(
                label, factor, {k: v for k, v in results[label, factor].items() if k != "curve"}, flush=True
            )
    rows = [
        f"| rule | rank {SLOW_RANK} slowed | samples/s | ÷ BSP | epochs to {args.target:.0%} "
        f"| s to {args.target:.0%} | final val accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for factor in args.factors:
        bsp = results.get(("BSP", factor))
        for label, _ in wanted:
            r = results[label, factor]
            ratio = r["rate"] / bsp["rate"] if bsp else math.nan
            rows.append(
                f"| {label} | {'none' if factor == 1 else f'{factor:g}×'} | {r['rate']:,.0f} | {ratio:.2f} | "
                f"{r['epoch']:.3g} | {r['seconds']:.2f} | {r['final']:.4f} |"
            )
    checks = []
    if ("BSP", 2.0) in results:
        bsp = results["BSP", 2.0]
        for label in ("ASGD", "SSP (s = 2)"):
            if (label, 2.0) in results:
                r = results[label, 2.0]
                ratio, gap = r["rate"] / bsp["rate"], (bsp["final"] - r["final"]) * 100
                holds = ratio >= 1.6 and gap <= 1.0
                checks.append(
                    f"- {label}, rank {SLOW_RANK} slowed 2×: {ratio:.2f}× BSP's samples/s, final accuracy "
                    f"{gap:+.1f} points below BSP → criterion (≥ 1.6×, within 1 point) "
                    f"{'holds' if holds else 'does not hold'}"
                )
        checks.append("- GSP: not implemented yet, not measured.")
    table = "\n".join(rows) + "\n\n" + "\n".join(checks)
    print(table)
    if not args.no_write:
        plot(results, args.factors, [label for label, _ in wanted], RESULTS / "stragglers.png")
        notes = (
            "Digits job, 4 ranks on 2 shared cores (oversubscribed), batch 16 per learner, 20 epochs; "
            "the asynchronous rules' ranks stop at their own pace. samples/s is Σ over training ranks of "
            "(own steps/s × 16). ![](stragglers.png)"
        )
        print(append_result("stragglers", "Every rule with one rank slowed", table, notes))


def plot(results: dict, factors: list[float], labels: list[str], path: Path) -> None:
    """Validation accuracy against wall time, one panel per slowdown, one curve per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(factors), figsize=(5 * len(factors), 4), sharey=True, squeeze=False)
    for ax, factor in zip(axes[0], factors, strict=True):
        for label in labels:
            times, accuracy = results[label, factor]["curve"]
            ax.plot(times, accuracy, marker=".", label=label)
        ax.set_title(f"rank {SLOW_RANK} slowed {factor:g}×" if factor > 1 else "no rank slowed")
        ax.set_xlabel("wall time (s)")
        ax.set_ylim(0.5, 1.0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
