"""Heterogeneous links — MXNet-G's setting: one node behind a slower link than the others.

A slow link costs no CPU, so on a 2-core machine it is the straggler that can be hosted fairly: every rank
computes at the same speed and only one node's traffic crawls. The nodes are Linux namespaces joined by
rate-limited virtual links (tests/netns_cluster.py, as root); two nodes, one rank each (a third rank would
wait for a core here), node2's link at a third of node1's rate in the second setting; the digits job
(launch/digits.cfg, 15 epochs, to 97 %) and MNIST-1D (launch/mnist1d.cfg, 30 epochs, to 90 %), a
validation after each epoch, under

* BSP (every step waits for the slow node),
* GSP with one group per node (a group's leader pushes to the servers asynchronously),
* ASGD and SSP (staleness 2) with the parameter server colocated on every rank,
* LOCALSGD (at its default period 8, and by hand at 4 and 16) and SMA,
* AUTO, the framework's own pick (its line says how its time compares with the best rule picked by hand).

Each rate setting is one mpiexec job across the nodes (tests/mpi_scripts/cfg_runs.py), each seed one job;
the table gives each rule's median wall seconds to the first validation at 97 % (metrics.h5's ``val``
rows; ``[session] target_accuracy`` would stop only synchronous rules, so every run trains all its epochs
and validations count alike for every rule), samples per second and final accuracy, and the ratio to BSP's
time in the same setting, measured side by side in one run.

    python -m benchmarks.links                       # 2 nodes: both at 30 mbit, then node2 at 10 mbit
    python -m benchmarks.links --tasks digits --rates 300mbit,100mbit --seeds 0
    python -m benchmarks.links --seeds "digits=0,1,2;mnist1d=0"
    python -m benchmarks.links --tasks mnist1d --seeds 0 --rules LOCALSGD --no-write   # AUTO against one
    python -m benchmarks.links --tasks digits --learners 4 --rules LOCALSGD   # k = 8: LOCALSGD's periods
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.report import REPO, append_result, cfg_runs
from benchmarks.sma_recipe import CFG_RECIPE
from mpicrossbow.training.reporting.metrics import read_metrics

sys.path.insert(0, str(REPO / "tests"))  # the namespace cluster is the test suite's own fixture
from netns_cluster import NetnsCluster, missing_reason, started

#: one rank per node: two ranks on the 2-core machine, so that no rank waits for a core
NODES = 2
#: task → (cfg, its overrides, target validation accuracy, default epochs)
TASKS = {
    "digits": ("launch/digits.cfg", "", 0.97, 15),
    "mnist1d": ("launch/mnist1d.cfg", ",".join(CFG_RECIPE), 0.90, 30),
}
#: The tbf queue: a packet that would wait longer is dropped. Long enough that TCP is not made to retransmit
#: a burst the link would carry a moment later (20 ms made the policer, not the rate, decide the times).
QUEUE = "200ms"
#: The token bucket (tc tbf burst): what goes at the line's own rate after a quiet moment. 8 KB, a few
#: packets: a link of the given rate for every message, as benchmarks/scaling_links.py's fitted links (4 KB).
#: Until 2026-12-02 it was 512 KB, five of the digits MLP's allreduces and more of MNIST-1D's CNN's: a rule
#: that exchanges now and then never emptied it, so such a link capped the average rate, not each message's,
#: and a short measurement of a lone allreduce (RULE=AUTO's) saw the line, not the rate.
BURST = "8kb"
#: label → the rule's overrides ({groups}: a file with one node's name per line).
RULES = {
    "BSP": "RULE=BSP",
    "GSP (groups = nodes)": "RULE=GSP,rule.groups={groups},rule.placement=colocated",
    "ASGD (colocated)": "RULE=ASGD,rule.placement=colocated",
    "SSP (colocated)": "RULE=SSP,rule.staleness=2,rule.placement=colocated",
    "LOCALSGD": "RULE=LOCALSGD",
    "LOCALSGD (period 4)": "RULE=LOCALSGD,rule.period=4",
    "LOCALSGD (period 16)": "RULE=LOCALSGD,rule.period=16",
    "SMA": "RULE=SMA",
    "AUTO": "RULE=AUTO",
}
#: The label of the rule the framework picks (RULE=AUTO); the others are picked by hand.
AUTO = "AUTO"


def common(epochs: int, learners: int = 1) -> list[str]:
    """The overrides every run takes: one thread per rank (each namespace node would otherwise take every
    core of the machine for its one rank, and the two ranks would fight for both), ``learners`` a rank."""
    return ["session.epochs=" + str(epochs), "session.log_level=warning", "session.threads=1",
            f"pool.learners={learners}"]  # fmt: skip


def measure(
    cluster: NetnsCluster,
    out: Path,
    task: str,
    seed: int,
    epochs: int,
    rules: list[str],
    learners: int = 1,
    target: float = 0.0,
) -> dict[str, dict[str, Any]]:
    """Each of ``rules`` at ``seed`` in one job across the cluster's nodes, ``learners`` a rank; label →
    seconds to ``target`` (0: the task's), samples/s, accuracy."""
    cfg, extra, task_target, _ = TASKS[task]
    target = target or task_target
    out.mkdir(parents=True, exist_ok=True)
    groups = out / "groups"
    groups.write_text("".join(f"{h}\n" for h in cluster.hosts), encoding="utf-8")
    labels = {f"r{i}": label for i, label in enumerate(rules)}
    specs = [
        f"{key}={cfg},{RULES[label].format(groups=groups)},session.seed={seed}"
        + (f",{extra}" if extra else "")
        for key, label in labels.items()
    ]
    folder = out / f"seed{seed}"
    cfg_runs(
        folder, NODES, specs, common(epochs, learners), 1800, f"seed {seed}",
        launch=lambda mpiexec, argv: cluster.mpiexec(mpiexec, 1, argv),
    )  # fmt: skip
    found = {}
    for key, label in labels.items():
        (run,) = (folder / key).iterdir()
        metrics = read_metrics(run / "metrics.h5")
        attrs, val = metrics["attrs"], metrics["val"]
        hits = [
            t
            for t, a, e in zip(val["time"], val["accuracy"], val["epoch"], strict=True)
            if a >= target and e == e
        ]
        found[label] = {
            "seconds": float(hits[0]) if hits else math.nan,
            "samples": float(attrs["samples_per_second"]),
            "accuracy": float(attrs["val_accuracy"]),
        }
        if "rule_auto_choice" in attrs:
            found[label]["choice"] = str(attrs["rule_auto_choice"])
            found[label]["line"] = str(attrs["rule_auto_line"])
    return found


def median(values: list[float]) -> float:
    """The median, a missed target (NaN) counting as the slowest."""
    return statistics.median([math.inf if math.isnan(v) else v for v in values])


def table(setting: str, target: float, results: list[dict[str, dict[str, Any]]]) -> str:
    """One rate setting's rows."""
    times = {label: median([r[label]["seconds"] for r in results]) for label in results[0]}
    lines = [
        f"**{setting}**",
        "",
        f"| rule | s to {target:.0%} (median) | ÷ BSP | reached | samples/s | final accuracy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in results[0]:
        reached = sum(not math.isnan(r[label]["seconds"]) for r in results)
        t = times[label]
        ratio = t / times["BSP"] if math.isfinite(t) and math.isfinite(times["BSP"]) else math.nan
        lines.append(
            f"| {label} | {'missed' if not math.isfinite(t) else f'{t:.2f}'} | "
            f"{'–' if math.isnan(ratio) else f'{ratio:.2f}'} | {reached}/{len(results)} | "
            f"{statistics.median(r[label]['samples'] for r in results):,.0f} | "
            f"{statistics.median(r[label]['accuracy'] for r in results):.4f} |"
        )
    by_hand = {label: t for label, t in times.items() if label != AUTO}
    best = min(by_hand, key=lambda label: by_hand[label])
    ratio = times[AUTO] / by_hand[best] if math.isfinite(by_hand[best]) else math.nan
    choices = sorted({r[AUTO].get("choice", "?") for r in results})
    lines += ["", f"auto ÷ best hand-picked: {ratio:.2f} (best: {best}; auto chose {', '.join(choices)})"]
    if "line" in results[0][AUTO]:
        lines += ["", f"AUTO's last decision, first seed: {results[0][AUTO]['line']}"]
    return "\n".join(lines)


def main() -> int:
    """Start the cluster, measure each rate setting, report."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="30mbit,10mbit", help="FAST,SLOW: every link, then node2's")
    parser.add_argument("--tasks", default="digits,mnist1d", help=f"of {', '.join(TASKS)}")
    parser.add_argument("--seeds", default="0,1,2", help="per task: TASK=SEEDS;... or the same for all")
    parser.add_argument("--epochs", type=int, default=0, help="0: each task's default")
    parser.add_argument(
        "--rules", default="", help="a subset by first word, comma-separated (BSP and AUTO always run)"
    )
    parser.add_argument("--learners", type=int, default=1, help="learners a rank (k = 2 × this)")
    parser.add_argument("--target", type=float, default=0.0, help="validation accuracy (0: each task's)")
    parser.add_argument("--burst", default=BURST, help="every link's token bucket (tc tbf burst)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    wanted = {"BSP", AUTO, *(w.strip().upper() for w in args.rules.split(",") if w.strip())}
    rules = [label for label in RULES if not args.rules or label.split()[0] in wanted]
    if args.rules and len(rules) < len(wanted):
        parser.error(f"--rules {args.rules}: known are {', '.join(label.split()[0] for label in RULES)}")
    reason = missing_reason()
    if reason:
        print(f"links: {reason}", file=sys.stderr)
        return 2
    fast, slow = args.rates.split(",")
    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    sections = []
    with started(NetnsCluster(NODES)) as cluster:
        for name in cluster.hosts:
            cluster.set_rate(name, fast, QUEUE, args.burst)
        with tempfile.TemporaryDirectory() as tmp:
            for task in tasks:
                seeds = [int(s) for s in seeds_for(args.seeds, task).split(",")]
                epochs = args.epochs or TASKS[task][3]
                target = args.target or TASKS[task][2]
                for setting, rate in (
                    (f"both links at {fast}", fast),
                    (f"node2's link at {slow}, node1's at {fast}", slow),
                ):
                    cluster.set_rate("node2", rate, QUEUE, args.burst)
                    folder = Path(tmp) / f"{task}-node2-{rate}"
                    results = [
                        measure(cluster, folder, task, s, epochs, rules, args.learners, target) for s in seeds
                    ]
                    sections.append(table(f"{task}, {epochs} epochs, {setting}", target, results))
                    print(sections[-1], flush=True)
    text = "\n\n".join(sections) + (
        f"\n\n{NODES} namespace nodes × 1 rank (one thread and {args.learners} learner(s) each), links "
        f"limited by tc tbf both ways (queue {QUEUE}, burst {args.burst}): wall seconds to the first "
        f"validation (one per epoch) at the task's target, seeds {args.seeds}, medians (a missed target "
        "counts last)."
    )
    if not args.no_write:
        print("appended to", append_result("links", "Heterogeneous links: one node behind a slow link", text))
    return 0


def seeds_for(spec: str, task: str) -> str:
    """The seeds of ``task`` from ``--seeds`` (``0,1,2`` for every task, or ``digits=0,1,2;mnist1d=0``)."""
    if "=" not in spec:
        return spec
    given = dict(part.split("=", 1) for part in spec.split(";"))
    return given.get(task, "0")


if __name__ == "__main__":
    sys.exit(main())
