"""A link that slows mid-run: does RULE=AUTO notice, switch, and reach the target sooner than staying with
its first choice?

Two namespace nodes, one rank each (tests/netns_cluster.py, as root), both links at a fast rate (by
default the virtual links' own, where the digits MLP's allreduce should be a few per cent of a step);
the digits job (launch/digits.cfg, to 96 %, a validation each epoch) with ``--learners`` learners a rank
(4: k = 8, where LOCALSGD needs 2.35× BSP's epochs, so on the fast links AUTO moves from LOCALSGD, which it
measures under, to BSP or SMA; at k = 2 LOCALSGD is within the model's error of BSP and AUTO keeps it from
the start, so no slowdown would call for a switch). When rank 0 logs the
end of epoch ``--after`` (3), node2's link drops to a slow rate (tc tbf, both ways). Each seed runs, side by
side in one session:

* AUTO, deciding again when the steps drift (``recheck``, its default);
* AUTO with ``recheck = false`` — staying with the first choice;
* BSP and LOCALSGD picked by hand.

The table gives each one's median wall seconds to 97 % (metrics.h5's ``val`` rows), AUTO's decisions (rule
and epoch of each) and how many epochs after the slowdown it switched.

    python -m benchmarks.link_slowdown                         # line rate, node2 to 10mbit after epoch 3
    python -m benchmarks.link_slowdown --fast 300mbit --slow 10mbit --seeds 0 --after 2 --learners 1
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.links import BURST, median
from benchmarks.report import REPO, append_result
from mpicrossbow.training.reporting.metrics import read_metrics

sys.path.insert(0, str(REPO / "tests"))  # the namespace cluster is the test suite's own fixture
from netns_cluster import NetnsCluster, missing_reason, started

#: label → the rule's overrides.
RULES = {
    "AUTO": ["RULE=AUTO"],
    "AUTO, recheck off": ["RULE=AUTO", "rule.recheck=false"],
    "BSP": ["RULE=BSP"],
    "LOCALSGD": ["RULE=LOCALSGD"],
}
#: 96 % in 30 epochs: at k = 8 the digits MLP levels off at 97-97.5 % (LOCALSGD reached 97 % at epoch 17
#: on one machine, BSP at 14), where one validation sample (0.28 %) decides whether a run reaches 97 %; a
#: first AUTO run here at 97 % did not reach it in 30 epochs.
TARGET, EPOCHS, QUEUE = 0.96, 30, "200ms"


def run(
    cluster: NetnsCluster, out: Path, rule: list[str], seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One job across both nodes: node2 at ``--fast`` until rank 0 logs epoch ``--after``, then ``--slow``;
    the seconds to the target, and AUTO's decisions as (rule, epoch) pairs."""
    for name in cluster.hosts:
        if args.fast == "line":
            cluster.clear_rate(name)
        else:
            cluster.set_rate(name, args.fast, QUEUE, args.burst)
    argv = [str(Path(sys.executable).parent / "crossbow-launch"), "-cfg", "launch/digits.cfg",
            f"session.output={out}", f"session.epochs={EPOCHS}",
            f"session.seed={seed}", "session.threads=1", "session.progress=log",
            f"pool.learners={args.learners}", *rule]  # fmt: skip
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    proc = subprocess.Popen(
        cluster.mpiexec(mpiexec, 1, argv), cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    slowed = False
    tail: list[str] = []
    lines: list[str] = []  # AUTO's decisions, each in its own words
    assert proc.stderr is not None
    for line in proc.stderr:
        tail = [*tail[-40:], line]
        if " AUTO at step " in line:
            lines.append(line.strip())
        if not slowed and f"INFO epoch {args.after} step " in line:
            cluster.set_rate("node2", args.slow, QUEUE, args.burst)
            slowed = True
    if proc.wait(timeout=900) != 0:
        raise RuntimeError("".join(tail))
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    metrics = read_metrics(folder / "metrics.h5")
    val, attrs = metrics["val"], metrics["attrs"]
    hits = [
        t
        for t, a, e in zip(val["time"], val["accuracy"], val["epoch"], strict=True)
        if a >= TARGET and e == e
    ]
    steps_per_epoch = int(attrs["steps"]) / EPOCHS
    labels = str(attrs.get("rule_auto_labels", "")).split("; ")
    decisions = [
        (labels[int(index)], float(step) / steps_per_epoch)
        for step, index, _ in attrs.get("rule_auto_decisions", [])
    ]
    return {"seconds": float(hits[0]) if hits else math.nan, "decisions": decisions, "lines": lines}


def table(results: dict[str, list[dict[str, Any]]], after: int) -> str:
    """Rows per rule: median seconds to target, ÷ AUTO with recheck off, and AUTO's decisions."""
    times = {label: median([r["seconds"] for r in rows]) for label, rows in results.items()}
    stay = times["AUTO, recheck off"]
    lines = [
        f"| rule | s to {TARGET:.0%} (median) | ÷ staying with the first choice | decisions (rule @ epoch) |",
        "|---|---:|---:|---|",
    ]
    for label, rows in results.items():
        t = times[label]
        ratio = t / stay if math.isfinite(t) and math.isfinite(stay) else math.nan
        decided = "; ".join(
            ", ".join(f"{rule} @ {epoch:.2f}" for rule, epoch in r["decisions"])
            for r in rows
            if r["decisions"]
        )
        lines.append(
            f"| {label} | {'missed' if not math.isfinite(t) else f'{t:.2f}'} | "
            f"{'–' if math.isnan(ratio) else f'{ratio:.2f}'} | {decided or '–'} |"
        )
    switches = [switched(r["decisions"], after) for r in results["AUTO"]]
    shown = ", ".join("never" if math.isnan(s) else f"{s:.2f}" for s in switches)
    lines += ["", f"AUTO switched {shown} epoch(s) after the slowdown (per seed; the first move to another "
              "rule than the one running then)"]  # fmt: skip
    return "\n".join(lines)


def switched(decisions: list[tuple[str, float]], after: int) -> float:
    """Epochs from the slowdown (at epoch ``after``) to the first decision after it that moved to another
    rule than the one running when the link slowed (a window on trial counts as running); NaN: none."""
    running = next((rule for rule, epoch in reversed(decisions) if epoch <= after), None)
    return next((epoch - after for rule, epoch in decisions if epoch > after and rule != running), math.nan)


def main() -> int:
    """Start the cluster, run every rule at every seed, report."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fast", default="line", help="both links' rate at the start (line: no limit, the veth's own)"
    )
    parser.add_argument("--slow", default="10mbit", help="node2's rate after the slowdown")
    parser.add_argument("--after", type=int, default=3, help="the epoch after which node2's link slows")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--learners", type=int, default=4, help="learners a rank (k = 2 × this)")
    parser.add_argument("--burst", default=BURST, help="the token bucket of a limited link (tc tbf burst)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    reason = missing_reason()
    if reason:
        print(f"link_slowdown: {reason}", file=sys.stderr)
        return 2
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in RULES}
    with started(NetnsCluster(2)) as cluster:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in [int(s) for s in args.seeds.split(",")]:
                for i, (label, rule) in enumerate(RULES.items()):
                    results[label].append(run(cluster, Path(tmp) / f"s{seed}r{i}", rule, seed, args))
                    print(label, seed, results[label][-1], flush=True)
    text = table(results, args.after) + (
        f"\n\n2 namespace nodes × 1 rank (one thread, {args.learners} learner(s) each), both links at "
        f"{args.fast} (line: unlimited; else tc tbf, queue {QUEUE}, burst {args.burst}), node2's at "
        f"{args.slow} once rank 0 logged epoch {args.after}; digits, {EPOCHS} epochs, "
        f"seeds {args.seeds}: wall seconds to the first validation at {TARGET:.0%}, medians (a miss counts "
        "last)."
    )
    print(text)
    if not args.no_write:
        print("appended to", append_result("link_slowdown", "A link that slows mid-run", text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
