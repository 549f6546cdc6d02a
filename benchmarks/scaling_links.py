"""The scaling cost model (mpicrossbow/rules/cost_model.py) on real links: nodes that talk over rate-limited
network links instead of one machine's shared memory.

    python -m benchmarks.scaling_links                 # fit at 30 and 100 mbit, validate at 50 mbit
    python -m benchmarks.scaling_links --fit-rates 20mbit,60mbit --rate 40mbit --steps 80 --rounds 2

The nodes are Linux namespaces joined by virtual Ethernet links (tests/netns_cluster.py, as root), one rank
per node, every link limited both ways by a token bucket of ``--burst`` (small: a real link of that rate
has no credit to spend; the test fixture's 512 kB bucket would carry a sparse rule's whole exchange at
line rate). Three steps, all in one cluster:

1. **fit** — at each of ``--fit-rates``, a 2-node job times a one-way MPI message at several sizes; one
   least-squares fit over both rates gives the link's latency α and its seconds per byte as
   ``β(R) = β₀ + k · 8/R`` (k: the wire's bytes per payload byte, TCP/IP and Ethernet headers; β₀: what the
   hosts add per byte), so the link at any rate R — ``--rate`` is none of the fitted ones by default;
2. **validate** — at ``--rate``, jobs of 2 and 3 nodes time the allreduce (blocking and not), a message of
   the model's size, one elementwise pass, and train the digits MLP (hidden ``--hidden``: comm-heavy on these
   links) ``--steps`` steps under every rule, plus LOCALSGD with a period longer than the run as the
   no-exchange floor, the median of ``--rounds`` interleaved rounds (benchmarks/scaling.py's
   ``measure_here``);
3. **predict** — each rule's step at 2 and 3 nodes from the floor and the fitted link on a cluster of one
   rank per node whose allreduce is MPICH's (halving–doubling, with a fold at 3 ranks), and the ratio to
   the measured step.

The machine's cores are shared by every node: at 3 nodes, 3 ranks on 2 cores, so the floor is measured with
that contention, the model stretches elementwise work by ranks ÷ cores and lets nothing overlap, and the
link's time is the wire's. Results are appended to benchmarks/results/scaling.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.report import REPO, append_result
from benchmarks.scaling import HYPER, RULES, model_bytes, time_comm, time_pass, time_rules
from mpicrossbow.rules.cost_model import Cluster, Link, cluster_allreduce, step_time

sys.path.insert(0, str(REPO / "tests"))  # the namespace cluster is the test suite's own fixture
from netns_cluster import NetnsCluster, missing_reason

NODES = (2, 3)
#: Message sizes of the fit: one-way times from a few kB (latency and a little wire) to the wire alone.
FIT_SIZES = (4 << 10, 32 << 10, 128 << 10, 512 << 10)
#: One torch thread per rank. The default, a node's cores ÷ its ranks, gives every rank of these one-rank
#: nodes all the machine's cores: 2 or 3 ranks × 2 spinning threads on 2 cores made the digits MLP's
#: forward and backward 300 times slower (140 ms a step instead of 0.4).
THREADS = ("session.threads=1",)
#: Seconds any one MPI job may take before it counts as hung.
JOB_TIMEOUT_S = 900.0
TC_TIMEOUT_S = 20.0
UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def bits_per_second(rate: str) -> float:
    """A tc rate (``30mbit``, ``1gbit``, ``500kbit``: decimal prefixes, as tc reads them) in bits a second."""
    match = re.fullmatch(r"([0-9.]+)\s*([kmg]?bit)", rate.strip().lower())
    if not match:
        raise ValueError(f"not a tc rate in bits: {rate!r} (e.g. 30mbit, 1gbit)")
    return float(match.group(1)) * UNITS[match.group(2)]


def shape(cluster: NetnsCluster, rate: str, burst: str) -> None:
    """Every node's link limited to ``rate`` both ways by a token bucket of ``burst`` (tbf on the node's end
    and on the switch's): as the cluster's own ``set_rate``, with a bucket of our size."""
    for node in cluster.members:
        for netns, dev in ((node.netns, node.inside), (cluster.switch, node.port)):
            tbf = ["tbf", "rate", rate, "burst", burst, "latency", "50ms"]
            cmd = ["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TC_TIMEOUT_S)
            if proc.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def job(cluster: NetnsCluster, nodes: int, argv: list[str], into: Path) -> dict[str, object]:
    """Run this module's measuring side (``--job ...``) on the first ``nodes`` nodes, one rank each; rank 0's
    JSON."""
    here = Path(sys.executable).parent / "mpiexec"
    launcher = str(here) if here.exists() else "mpiexec"
    inner = [sys.executable, "-m", "benchmarks.scaling_links", *argv, "--measure-into", str(into)]
    cmd = cluster.mpiexec(launcher, 1, inner, nodes=nodes)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    if proc.returncode or not into.exists():
        raise RuntimeError(
            f"{' '.join(argv)} on {nodes} nodes failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(into.read_text())


def measure_fit() -> dict[str, object]:
    """Under mpiexec, 2 ranks: one-way message times at FIT_SIZES over plain MPI."""
    from mpi4py import MPI

    from mpicrossbow.comm.mpi import MPICommunicator

    world = MPI.COMM_WORLD
    comm = MPICommunicator(world)
    links = time_comm(world, comm, FIT_SIZES, ("p2p",), repeats=12)
    comm.close()
    return {"size": world.size, "rank": world.rank, "links": links}


def measure_rules(steps: int, rounds: int, hidden: int) -> dict[str, object]:
    """Under mpiexec, one rank per node: the model-sized allreduce (blocking and not) and message, one
    elementwise pass, and every rule's (and the floor's) seconds per step."""
    import torch
    from mpi4py import MPI

    from mpicrossbow.comm import make_communicator
    from mpicrossbow.config.sections import CommSection

    torch.set_num_threads(1)  # as every run's session.threads: see THREADS
    world = MPI.COMM_WORLD
    comm = make_communicator(CommSection(), "cpu", world)  # what the rules get: plain MPI, one rank a node
    kind = type(comm).__name__
    links = time_comm(world, comm, (model_bytes(hidden),), ("allreduce", "iallreduce", "p2p"), repeats=12)
    overlaps = comm.overlaps
    comm.close()
    gamma = time_pass(world, hidden)
    timed = time_rules(world, steps, rounds, hidden, THREADS)
    per_step = {label: statistics.median(t) for label, t in timed.items()}
    return {
        "size": world.size, "rank": world.rank, "links": links, "per_step": per_step, "gamma": gamma,
        "overlaps": overlaps, "communicator": kind, "cores": len(os.sched_getaffinity(0)),
    }  # fmt: skip


def fit_links(fits: dict[str, dict[str, object]]) -> tuple[float, float, float]:
    """Least squares over every fit rate's one-way times: ``t = α + n (β₀ + k · 8/R)``; (α, β₀, k)."""
    rows, times = [], []
    for rate, measured in fits.items():
        wire = 8 / bits_per_second(rate)
        for size, seconds in measured["links"]["p2p"]:  # type: ignore[index]
            rows.append([1.0, float(size), float(size) * wire])
            times.append(float(seconds))
    (alpha, beta0, k), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return max(float(alpha), 0.0), float(beta0), float(k)


def link_at(fit: tuple[float, float, float], rate: str) -> Link:
    """The fitted link at ``rate``."""
    alpha, beta0, k = fit
    return Link(alpha, max(beta0 + k * 8 / bits_per_second(rate), 1e-15))


def namespace_cluster(link: Link, measured: list[dict[str, object]]) -> Cluster:
    """The namespace cluster as the model sees it: one rank per node, the fitted link between nodes, MPICH's
    allreduce, the measured elementwise pass, and the machine's cores shared by every node."""
    gamma = statistics.mean(float(m["gamma"]) for m in measured)  # type: ignore[arg-type]
    cores = min(int(m["cores"]) for m in measured)  # type: ignore[call-overload]
    overlaps = all(bool(m["overlaps"]) for m in measured)
    return Cluster(
        "namespace nodes", gpus_per_node=1, intra=link, inter=link, gamma=gamma, overlaps=overlaps,
        cores=cores, collectives="mpich",
    )  # fmt: skip


def fit_rows(fits: dict[str, dict[str, object]], fit: tuple[float, float, float]) -> list[str]:
    """The fit's one-way times, measured and fitted, at every rate and size."""
    rows = ["| rate | message | measured ms | fitted | fitted ÷ measured |", "|---|---|---|---|---|"]
    for rate, measured in fits.items():
        link = link_at(fit, rate)
        for size, seconds in measured["links"]["p2p"]:  # type: ignore[index]
            fitted = link.message(size)
            cells = f"{seconds * 1e3:.2f} | {fitted * 1e3:.2f} | {fitted / seconds:.2f}"
            rows.append(f"| {rate} | {size >> 10} kB | {cells} |")
    return rows


def link_rows(measured: list[dict[str, object]], cluster: Cluster, nbytes: int) -> list[str]:
    """Measured vs predicted collective and message times of the model's size at each node count."""
    rows = ["| operation | nodes | measured ms | predicted | predicted ÷ measured |", "|---|---|---|---|---|"]
    for m in measured:
        p = int(m["size"])  # type: ignore[call-overload]
        links = m["links"]  # type: ignore[index]
        for kind, predicted in (
            ("allreduce", cluster_allreduce(nbytes, p, cluster)),
            ("iallreduce", cluster_allreduce(nbytes, p, cluster)),
            ("p2p", cluster.inter.message(nbytes)),
        ):
            ((_, got),) = links[kind]  # type: ignore[index]
            rows.append(f"| {kind} | {p} | {got * 1e3:.2f} | {predicted * 1e3:.2f} | {predicted / got:.2f} |")
    return rows


def rule_rows(measured: list[dict[str, object]], cluster: Cluster, nbytes: int) -> tuple[list[str], float]:
    """Measured vs predicted seconds per step for every rule at every node count; the worst |ratio − 1|."""
    rows = ["| rule | nodes | measured ms/step | predicted | predicted ÷ measured |", "|---|---|---|---|---|"]
    worst = 0.0
    for m in measured:
        p, per_step = int(m["size"]), m["per_step"]  # type: ignore[call-overload]
        floor = per_step["floor"]  # type: ignore[index]
        rows.append(f"| (no exchange: the floor) | {p} | {floor * 1e3:.3f} | — | — |")
        for rule in RULES:
            if p < 3 and rule == "GSP":  # GSP's groups need workers beside its server
                continue
            predicted = step_time(rule, p, floor, nbytes, cluster, **HYPER.get(rule, {})).seconds  # type: ignore[arg-type]
            got = per_step[rule]  # type: ignore[index]
            worst = max(worst, abs(predicted / got - 1))
            rows.append(f"| {rule} | {p} | {got * 1e3:.3f} | {predicted * 1e3:.3f} | {predicted / got:.2f} |")
    return rows, worst


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Start the cluster, run the fit and validation jobs, stop it (on every way out: SIGTERM too)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SystemExit runs the finally below
    cluster = NetnsCluster(max(NODES)).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            fits = {}
            for rate in args.fit_rates.split(","):
                shape(cluster, rate, args.burst)
                started = time.perf_counter()
                fits[rate] = job(cluster, 2, ["--job", "fit"], Path(tmp) / f"fit-{rate}.json")
                print(f"fit at {rate}: {time.perf_counter() - started:.0f} s", flush=True)
            shape(cluster, args.rate, args.burst)
            validation = []
            for nodes in NODES:
                started = time.perf_counter()
                argv = ["--job", "rules", "--steps", str(args.steps), "--rounds", str(args.rounds)]
                argv += ["--hidden", str(args.hidden)]
                validation.append(job(cluster, nodes, argv, Path(tmp) / f"rules-{nodes}.json"))
                print(f"{nodes} nodes at {args.rate}: {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        cluster.stop()
    return {
        "fit": fits, "validation": validation, "rate": args.rate, "burst": args.burst,
        "hidden": args.hidden, "steps": args.steps, "rounds": args.rounds,
    }  # fmt: skip


def report(measured: dict[str, object]) -> tuple[str, float]:
    """The results section (markdown) and the worst |predicted ÷ measured − 1| over the rules."""
    fits: dict[str, dict[str, object]] = measured["fit"]  # type: ignore[assignment]
    validation: list[dict[str, object]] = measured["validation"]  # type: ignore[assignment]
    rate, hidden = str(measured["rate"]), int(measured["hidden"])  # type: ignore[call-overload]
    fit = fit_links(fits)
    link = link_at(fit, rate)
    cluster = namespace_cluster(link, validation)
    nbytes = model_bytes(hidden)
    rules, worst = rule_rows(validation, cluster, nbytes)
    alpha, beta0, k = fit
    fitted = ", ".join(
        f"{r}: {link_at(fit, r).beta * 1e9:.0f} ns/B ({8 / link_at(fit, r).beta / 1e6:.1f} Mbit/s of payload)"
        for r in fits
    )
    communicators = sorted({str(m["communicator"]) for m in validation})
    text = (
        "Namespace nodes (tests/netns_cluster.py), one rank per node, every link limited both ways by tc "
        f"tbf (burst {measured['burst']}). **Fit** on one-way MPI messages of "
        f"{', '.join(f'{s >> 10} kB' for s in FIT_SIZES)} between 2 nodes at {', '.join(fits)}: "
        f"α = {alpha * 1e6:.0f} µs, β(R) = {beta0 * 1e9:.2f} ns/B + {k:.3f} · 8/R ({fitted}). "
        f"**Validation** at {rate} (β = {link.beta * 1e9:.0f} ns/B; not a fitted rate unless listed above): "
        f"digits MLP hidden {hidden} ({nbytes / 1e3:.0f} kB of fp32 parameters), {measured['steps']} steps "
        f"per rule, median of {measured['rounds']} interleaved rounds; communicator "
        f"{', '.join(communicators)}; one elementwise pass γ n = {cluster.gamma * nbytes * 1e3:.3f} ms; "
        f"{cluster.cores} cores shared by every node. The model: one rank per node, MPICH's allreduce "
        "(halving–doubling; at 3 ranks a fold, 3 (α + n β)), network time not stretched by the shared cores. "
        f"Worst |predicted ÷ measured − 1| over the rules: {worst:.0%}.\n\n"
        "The fit:\n\n"
        + "\n".join(fit_rows(fits, fit))
        + f"\n\nCollectives and a message of the model's size at {rate}, the fitted link's prediction:\n\n"
        + "\n".join(link_rows(validation, cluster, nbytes))
        + f"\n\nEvery rule's step at {rate}:\n\n"
        + "\n".join(rules)
    )
    return text, worst


def main(argv: list[str]) -> int:
    """Measure (or reload measurements), fit, validate and append the results."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling_links",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--fit-rates", default="30mbit,100mbit", help="tc rates of the fit, comma-separated")
    parser.add_argument("--rate", default="50mbit", help="the tc rate the rules are validated at")
    parser.add_argument("--burst", default="4kb", help="the token bucket of every link (tc tbf burst)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units of the digits MLP")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every rule (median)")
    parser.add_argument("--measured", type=Path, help="JSON of an earlier run's measurements: refit only")
    parser.add_argument("--save-measured", type=Path, help="write this run's measurements (JSON) here")
    parser.add_argument("--no-write", action="store_true", help="print the section, append nothing")
    parser.add_argument("--job", choices=("fit", "rules"), help=argparse.SUPPRESS)  # the MPI jobs' side
    parser.add_argument("--measure-into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        result = measure_fit() if args.job == "fit" else measure_rules(args.steps, args.rounds, args.hidden)
        if result["rank"] == 0:
            args.measure_into.write_text(json.dumps(result))
        return 0
    if args.measured:
        measured = json.loads(args.measured.read_text())
    else:
        reason = missing_reason()
        if reason:
            print(f"benchmarks.scaling_links: {reason}", file=sys.stderr)
            return 2
        measured = measure(args)
        if args.save_measured:
            args.save_measured.write_text(json.dumps(measured))
    text, _ = report(measured)
    print(text)
    if not args.no_write:
        path = append_result("scaling", f"Scaling cost model on namespace links at {measured['rate']}", text)
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
