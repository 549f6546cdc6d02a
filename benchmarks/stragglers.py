"""Stragglers: what one slow rank does to every rule — samples/s, time to accuracy, final accuracy.

Every rule runs two tasks on 4 ranks three times each: no rank slowed, rank 3 slowed 2× and 4×
(``session.slow_ranks=3 session.slow_factor=F``: rank 3 sleeps (F − 1) × each of its own steps). The tasks:
the digits job (launch/digits.cfg, MLP, 20 epochs) and a CIFAR-sized ResNet-20 on synthetic 3×32×32 data
(launch/resnet20_synthetic.cfg, 8 epochs, lr divided by 10 after 6). For the parameter-server rules (ASGD,
SSP, PSGD, WEEDOUT, GSP) and async EASGD rank 0 serves, so the slowed rank is one of three workers. SSP
runs twice: with its default clock of one push per step (τ = 1) and with a clock of 8 local steps (τ = 8,
Ho et al.'s clock as a unit of work: s = 2 then bounds the advance to 2 clocks). GSP runs four ways: with
a groups file that puts the slow rank 3 in a group of its own (ranks 1 and 2 together); with that file and a
data-sharding file giving each worker a share of the data proportional to its speed (rank 3 slowed F×:
shares 1 : 1 : 1/F, so both groups finish their epochs together, as MXNet-G intends); and with
``groups = auto``; the shares run once more with τ = 8 (the group's leader pushes every 8 steps; the group
still sums its gradients every step).
Reports the aggregate training throughput (each training rank's own steps/s while it trained × its batch,
summed: an asynchronous job's wall time is set by its slowest worker finishing its epochs, so whole-job
samples/s would hide what the fast ranks do), the ratio to BSP under the same slowdown, epochs and seconds
until the validated model first reaches the target, and the final accuracy; then checks the issue's criterion:
with one rank slowed 2×, ASGD, SSP (s ≥ 2) and GSP (the slow rank in its own group) keep ≥ 1.6× BSP's
samples/s with final accuracy within one point of BSP's; the table records whether each holds. Writes
``benchmarks/results/stragglers.md`` and one PNG per task.

    python -m benchmarks.stragglers [--tasks digits resnet20] [--factors 1 2 4] [--rules BSP ASGD ...]
                                    [--repeats 3]   # medians of 3 runs (one run's ratio varies ±20 % here)
"""

from __future__ import annotations

import argparse
import itertools
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

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
    ("SSP (s = 2, τ = 8)", ["RULE=SSP", "rule.staleness=2", "rule.tau=8"]),
    ("PSGD", ["RULE=PSGD"]),
    ("WEEDOUT", ["RULE=WEEDOUT"]),
    ("GSP (file)", ["RULE=GSP", "rule.groups={groups}"]),
    ("GSP (file, shares)", ["RULE=GSP", "rule.groups={groups}", "rule.shares={shares}"]),
    ("GSP (file, shares, τ = 8)", ["RULE=GSP", "rule.groups={groups}", "rule.shares={shares}", "rule.tau=8"]),
    ("GSP (auto)", ["RULE=GSP", "rule.groups=auto"]),
    ("ASGD colocated", ["RULE=ASGD", "rule.placement=colocated"]),
    ("SSP (s = 2) colocated", ["RULE=SSP", "rule.staleness=2", "rule.placement=colocated"]),
    (
        "GSP colocated (file, shares)",
        ["RULE=GSP", "rule.placement=colocated", "rule.groups={cgroups}", "rule.shares={cshares}"],
    ),
    ("LOCALSGD", ["RULE=LOCALSGD"]),
    ("DILOCO", ["RULE=DILOCO"]),
]
RANKS, SLOW_RANK = 4, 3
#: The GSP groups file: the slow rank alone (placement = rank: rank 0 serves; colocated: it trains too).
GROUPS, COLOCATED_GROUPS = "1 2\n3\n", "0 1 2\n3\n"
#: task: (cfg, samples per step of one rank (one learner, batch 16 in both cfgs), target accuracy).
TASKS = {
    "digits": ("launch/digits.cfg", 16, 0.95),
    "resnet20": ("launch/resnet20_synthetic.cfg", 16, 0.90),
}
#: The rules the issue's criterion names.
CRITERION = (
    "ASGD",
    "SSP (s = 2)",
    "SSP (s = 2, τ = 8)",
    "GSP (file)",
    "GSP (file, shares)",
    "GSP (file, shares, τ = 8)",
    "ASGD colocated",
    "SSP (s = 2) colocated",
    "GSP colocated (file, shares)",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="tasks to run")
    parser.add_argument("--factors", type=float, nargs="+", default=[1, 2, 4], help="slowdowns of rank 3")
    parser.add_argument("--rules", nargs="+", help="labels to run (default all)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of every (rule, slowdown); the table shows their medians"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/")
    return parser.parse_args()


def launch(cfg: str, overrides: list[str], out: Path) -> dict:
    """One 4-rank run; its metrics."""
    from mpicrossbow.training.reporting.metrics import read_metrics

    here = Path(sys.executable).parent
    cmd = [str(here / "mpiexec"), "-n", str(RANKS), str(here / "crossbow-launch"), "-cfg",
           cfg, f"session.output={out}", "session.progress=off", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return read_metrics(run / "metrics.h5")


def shares_file(factor: float, colocated: bool = False) -> str:
    """A data-sharding file for ranks 0..3: the server's placeholder line, then shares 1 : 1 : 1/factor
    (colocated: every rank trains, shares 1 : 1 : 1 : 1/factor)."""
    if colocated:
        fast = 1.0 / (3.0 + 1.0 / factor)
        edges, lines = [0.0, fast, 2 * fast, 3 * fast, 1.0], []
    else:
        fast = 1.0 / (2.0 + 1.0 / factor)
        edges, lines = [0.0, fast, 2 * fast, 1.0], ["0 0"]
    lines += [f"{lo:.6f} {hi:.6f}" for lo, hi in itertools.pairwise(edges)]
    return "\n".join(lines) + "\n"


def to_target(metrics: dict, target: float) -> tuple[float, float]:
    """(epoch, seconds) of the first validation at or above ``target``; NaN if never."""
    val = metrics["val"]
    hits = np.nonzero(val["accuracy"] >= target)[0]
    if not len(hits):
        return math.nan, math.nan
    return float(val["epoch"][hits[0]]), float(val["time"][hits[0]])


def run_once(task: str, factor: float, overrides: list[str]) -> dict:
    """One run of a rule on ``task`` with rank 3 slowed ``factor``×: its figures and validation curve."""
    cfg, batch, target = TASKS[task]
    slow = [f"session.slow_ranks={SLOW_RANK}", f"session.slow_factor={factor:g}"] if factor > 1 else []
    with tempfile.TemporaryDirectory() as tmp:
        files = {name: Path(tmp) / f"{name}.txt" for name in ("groups", "shares", "cgroups", "cshares")}
        files["groups"].write_text(GROUPS)
        files["shares"].write_text(shares_file(factor))
        files["cgroups"].write_text(COLOCATED_GROUPS)
        files["cshares"].write_text(shares_file(factor, colocated=True))
        out = Path(tmp) / "runs"
        out.mkdir()
        metrics = launch(cfg, [o.format(**files) for o in overrides] + slow, out)
    epoch, seconds = to_target(metrics, target)
    rates = [r for r in metrics["attrs"]["rank_steps_per_second"] if r == r]  # NaN: a server rank
    return {
        "rate": batch * float(sum(rates)),
        "epoch": epoch,
        "seconds": seconds,
        "final": float(metrics["val"]["accuracy"][-1]),
        "curve": (metrics["val"]["time"], metrics["val"]["accuracy"]),
    }


def run_task(task: str, factors: list[float], wanted: list[tuple[str, list[str]]], repeats: int) -> dict:
    """Every wanted rule at every slowdown on ``task``, ``repeats`` times (rounds in turn, so machine noise
    hits every rule alike): the medians, keyed by (label, factor), with the spread of samples/s."""
    runs: dict[tuple[str, float], list[dict]] = {}
    for _ in range(repeats):
        for factor in factors:
            for label, overrides in wanted:
                run = run_once(task, factor, overrides)
                runs.setdefault((label, factor), []).append(run)
                shown = {k: v for k, v in run.items() if k != "curve"}
                print(task, label, factor, shown, flush=True)
    results: dict[tuple[str, float], dict] = {}
    for key, done in runs.items():
        median = {k: float(np.median([r[k] for r in done])) for k in ("rate", "epoch", "seconds", "final")}
        rates = [r["rate"] for r in done]
        median.update(low=min(rates), high=max(rates), repeats=len(done), curve=done[0]["curve"])
        results[key] = median
    return results


def table(task: str, results: dict, factors: list[float], labels: list[str]) -> str:
    """The markdown table of one task and the criterion check under a 2× slowdown."""
    target = TASKS[task][2]
    rows = [
        f"| rule | rank {SLOW_RANK} slowed | samples/s | ÷ BSP | epochs to {target:.0%} "
        f"| s to {target:.0%} | final val accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for factor in factors:
        bsp = results.get(("BSP", factor))
        for label in labels:
            r = results[label, factor]
            ratio = r["rate"] / bsp["rate"] if bsp else math.nan
            spread = f" ({r['low']:,.0f}–{r['high']:,.0f})" if r["repeats"] > 1 else ""
            rows.append(
                f"| {label} | {'none' if factor == 1 else f'{factor:g}×'} | {r['rate']:,.0f}{spread} | "
                f"{ratio:.2f} | "
                f"{r['epoch']:.3g} | {r['seconds']:.2f} | {r['final']:.4f} |"
            )
    checks = []
    if ("BSP", 2.0) in results:
        bsp = results["BSP", 2.0]
        for label in CRITERION:
            if (label, 2.0) in results:
                r = results[label, 2.0]
                ratio, gap = r["rate"] / bsp["rate"], (bsp["final"] - r["final"]) * 100
                sooner = bsp["seconds"] / r["seconds"] if r["seconds"] > 0 else math.nan
                holds = (ratio >= 1.6 and gap <= 1.0) or sooner >= 1.6
                runs = f" (medians of {r['repeats']} runs)" if r["repeats"] > 1 else ""
                checks.append(
                    f"- {task}, {label}, rank {SLOW_RANK} slowed 2×{runs}: {ratio:.2f}× BSP's samples/s, "
                    f"final accuracy {abs(gap):.1f} points {'below' if gap > 0 else 'above'} BSP's, target "
                    f"reached {sooner:.2f}× sooner → criterion (≥ 1.6× with accuracy within 1 point, or "
                    f"≥ 1.6× sooner to the target) {'holds' if holds else 'does not hold'}"
                )
    return "\n".join(rows) + "\n\n" + "\n".join(checks)


def main() -> None:
    args = parse_args()
    wanted = [r for r in RULES if args.rules is None or r[0] in args.rules]
    labels = [label for label, _ in wanted]
    for task in args.tasks:
        results = run_task(task, args.factors, wanted, args.repeats)
        text = table(task, results, args.factors, labels)
        print(text)
        if args.no_write:
            continue
        png = "stragglers.png" if task == "digits" else f"stragglers_{task}.png"
        plot(results, args.factors, labels, RESULTS / png)
        cfg, batch, _ = TASKS[task]
        notes = (
            f"Task {task} ({cfg}), 4 ranks on 2 shared cores (oversubscribed), batch {batch} per learner; "
            "the asynchronous rules' ranks stop at their own pace. samples/s is Σ over training ranks of "
            f"(own steps/s × {batch})"
            + (f", the median of {args.repeats} runs (min–max)" if args.repeats > 1 else "")
            + f". ![]({png})"
        )
        print(append_result("stragglers", f"Every rule with one rank slowed: {task}", text, notes))


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
        ax.set_ylim(0.0, 1.0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
