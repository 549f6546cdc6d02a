"""How each rule scales past one machine: the cost model (mpicrossbow/rules/cost_model.py) fitted to this
machine's links, checked against measured steps at 2 and 4 ranks, and run on cluster files to 1,024 GPUs.

    python -m benchmarks.scaling                              # validate here, then both example clusters
    python -m benchmarks.scaling --cluster benchmarks/clusters/h100_ib.ini --model resnet50 --no-validate

Validation (``mpiexec -n 2`` and ``-n 4`` jobs): each times the communicator's allreduce and a one-way
isend/irecv at several sizes (the slowest rank's median between barriers) and trains a comm-heavy digits MLP
(hidden 1,024: 1.1 M parameters, 4.4 MB) ``--steps`` steps under every rule, plus LOCALSGD with a period
longer than the run as the no-exchange compute floor. α and β are fitted by least squares to the allreduce
(the ring formula at 2 and 4 ranks) and point-to-point times together; each rule's predicted step is the
floor plus its modelled communication. The prediction tables for the clusters take compute per step from the
cluster file and parameter counts from it or from the zoo. Results go to benchmarks/results/scaling.md and
benchmarks/results/scaling-<cluster>.png.
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import REPO, append_result, relaunch
from mpicrossbow.rules.cost_model import Cluster, Link, scaling_efficiency, step_time

CLUSTERS = REPO / "benchmarks" / "clusters"
RULES = ("BSP", "SMA", "EASGD", "LOCALSGD", "DILOCO", "GOSGD", "ASGD", "SSP", "PSGD", "WEEDOUT", "GSP")
#: The rules' settings in the validation runs and in the model (τ, H and p where the rule has them).
HYPER: dict[str, dict[str, float]] = {
    **{rule: {"period": 1} for rule in ("ASGD", "SSP", "PSGD", "WEEDOUT", "GSP")},  # τ = 1, their default
    "EASGD": {"period": 10},
    "LOCALSGD": {"period": 8},
    "DILOCO": {"period": 8},
    "GOSGD": {"gossip": 0.01},
}
OVERRIDES = {"EASGD": ["rule.tau=10"], "LOCALSGD": ["rule.period=8"], "DILOCO": ["rule.period=8"]}
GPUS = (1, 2, 8, 64, 256, 1024)
SIZES = (16 << 10, 256 << 10, 4 << 20)
HIDDEN = 1024


def load_cluster(path: Path) -> tuple[Cluster, dict[str, float], int]:
    """The cluster file: (Cluster, parameter counts it gives, images per GPU)."""
    ini = configparser.ConfigParser(inline_comment_prefixes=("#",))
    if not ini.read(path):
        sys.exit(f"benchmarks.scaling: no cluster file {path}")
    c = ini["cluster"]

    def link(side: str) -> Link:
        return Link(c.getfloat(f"{side}_latency_us") * 1e-6, 8 / (c.getfloat(f"{side}_gbit_per_s") * 1e9))

    compute = {k: float(v) for k, v in ini["compute"].items()}
    params = {k: float(v) for k, v in ini["params"].items()} if "params" in ini else {}
    gamma = 1 / (c.getfloat("pass_gbyte_per_s") * 1e9)
    cluster = Cluster(
        path.stem, c.getint("gpus_per_node"), link("intra"), link("inter"), gamma, compute=compute
    )
    return cluster, params, c.getint("batch", fallback=64)


def zoo_params(model: str) -> float:
    """Parameters of a zoo model (built on the CPU once)."""
    import models.imagenet_resnet as imagenet

    builders = {"resnet50": imagenet.resnet50, "resnet18": imagenet.resnet18}
    if model not in builders:
        sys.exit(
            f"benchmarks.scaling: model {model!r} is neither in the cluster file nor in {sorted(builders)}"
        )
    return float(sum(p.numel() for p in builders[model]().parameters()))


def prediction_rows(cluster: Cluster, model: str, nbytes: float, batch: int) -> list[str]:
    """Markdown rows: per rule, step ms / samples/s / efficiency at each GPU count."""
    compute = cluster.compute[model]
    rows = [
        "| rule | " + " | ".join(f"{p} GPUs" for p in GPUS) + " |",
        "|---|" + "---|" * len(GPUS),
    ]
    for rule in RULES:
        cells = []
        for p in GPUS:
            if p == 1 and rule in ("ASGD", "SSP", "PSGD", "WEEDOUT", "GSP"):
                cells.append("—")
                continue
            step = step_time(rule, p, compute, nbytes, cluster, **HYPER.get(rule, {}))
            rate = step.training_ranks * batch / step.seconds
            eff = scaling_efficiency(rule, p, compute, nbytes, cluster, **HYPER.get(rule, {}))
            cells.append(f"{step.seconds * 1e3:.0f} ms, {rate:,.0f}/s, {eff:.0%}")
        rows.append(f"| {rule} | " + " | ".join(cells) + " |")
    return rows


def plot(cluster: Cluster, model: str, nbytes: float, path: Path) -> None:
    """Efficiency against GPUs, one line per rule."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), layout="constrained")
    ax = figure.subplots()
    gpus = [p for p in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)]
    for rule in RULES:
        ax.plot(
            gpus,
            [
                scaling_efficiency(rule, p, cluster.compute[model], nbytes, cluster, **HYPER.get(rule, {}))
                for p in gpus
            ],
            marker=".",
            label=rule,
        )
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency")
    ax.set_title(f"{model} on {cluster.name} (cost model)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncols=2)
    figure.savefig(path, dpi=110)


# ------------------------------------------------------------------ measuring here
def time_comm(
    world: Any,
    comm: Any,
    sizes: tuple[int, ...] = SIZES,
    kinds: tuple[str, ...] = ("allreduce", "p2p"),
    repeats: int = 15,
) -> dict[str, list[tuple[int, float]]]:
    """The communicator's allreduce (``iallreduce``: started non-blocking, then waited for) and a one-way
    isend/irecv (``p2p``, 0 → 1) at ``sizes``: the slowest rank's median of ``repeats`` (the first 3 left out,
    as warm-up)."""
    import torch
    from mpi4py import MPI

    out: dict[str, list[tuple[int, float]]] = {kind: [] for kind in kinds}
    for size in sizes:
        buf = torch.ones(size // 4)
        for kind in kinds:
            samples = []
            for _ in range(repeats):
                world.Barrier()
                start = time.perf_counter()
                if kind in ("allreduce", "iallreduce"):
                    comm.allreduce(buf, async_op=kind == "iallreduce").wait()
                elif comm.rank == 0:
                    comm.isend(buf, 1, 77).wait()
                elif comm.rank == 1:
                    comm.irecv(buf, 0, 77).wait()
                samples.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
            out[kind].append((size, statistics.median(samples[3:])))
    return out


def measure_here(steps: int, rounds: int) -> dict[str, object]:
    """Under mpiexec: link timings and every rule's (and the floor's) seconds per step on this world, the
    median of ``rounds`` interleaved rounds (a shared machine's load drifts: each round runs every rule)."""
    from mpi4py import MPI

    from mpicrossbow.comm import make_communicator
    from mpicrossbow.comm.mpi import MPICommunicator
    from mpicrossbow.config.sections import CommSection

    world = MPI.COMM_WORLD
    comm = make_communicator(CommSection(), "cpu", world)
    links = time_comm(world, comm)
    overlaps = comm.overlaps
    comm.close()
    plain = MPICommunicator(world)  # what a split communicator (GSP's groups) is
    links["group"] = time_comm(world, plain)["allreduce"]
    plain.close()
    gamma = time_pass(world)
    per_step = {label: statistics.median(times) for label, times in time_rules(world, steps, rounds).items()}
    return {
        "size": world.size, "rank": world.rank, "links": links, "per_step": per_step, "gamma": gamma,
        "overlaps": overlaps, "cores": len(os.sched_getaffinity(0)),
    }  # fmt: skip


def time_rules(
    world: Any, steps: int, rounds: int, hidden: int = HIDDEN, extra: tuple[str, ...] = ()
) -> dict[str, list[float]]:
    """Seconds per step (slowest rank) of the floor and every rule, ``rounds`` times each, interleaved, on the
    digits MLP with two hidden layers of ``hidden``, every run with the ``extra`` overrides. One untimed run
    of the floor comes first: a process's first training pays for warming up (imports, allocations) that no
    later run does."""
    from mpi4py import MPI

    from mpicrossbow.config import load_config
    from mpicrossbow.training.run.runner import prepare_session, train

    floor = ["rule.period=" + str(10 * steps)]
    runs = [("floor", "LOCALSGD", floor), *((r, r, OVERRIDES.get(r, [])) for r in RULES)]
    times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    with tempfile.TemporaryDirectory() as out:

        def seconds_per_step(rule: str, own: list[str]) -> float:
            overrides = [
                f"RULE={rule}", f"session.steps={steps}", "session.validate_every=0",
                "session.progress=off", "session.log_level=warning", f"session.output={out}",
                f"model.hidden={hidden}", *extra, *own,
            ]  # fmt: skip
            w, session, code = prepare_session(load_config("launch/digits.cfg", overrides))
            if code:
                sys.exit(code)
            result = train(w, session)
            mine = result.train_seconds if result.train_seconds == result.train_seconds else 0.0
            return float(world.allreduce(mine, op=MPI.MAX)) / steps

        seconds_per_step("LOCALSGD", floor)  # the warm-up
        for _ in range(rounds):
            for label, rule, own in runs:
                times[label].append(seconds_per_step(rule, own))
    return times


def time_pass(world: Any, hidden: int = HIDDEN) -> float:
    """Seconds per byte of one elementwise pass (``a += b``) over the validation model's parameters (the
    digits MLP with hidden layers of ``hidden``), every rank at once: the slowest rank's median."""
    import torch
    from mpi4py import MPI

    nbytes = model_bytes(hidden)
    buffers = [torch.ones(nbytes // 4) for _ in range(8)]  # as many as a rule touches: not in cache
    samples = []
    for i in range(24):
        world.Barrier()
        start = time.perf_counter()
        buffers[i % 8].add_(buffers[(i + 3) % 8])
        samples.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return statistics.median(samples[8:]) / nbytes


def model_bytes(hidden: int = HIDDEN) -> int:
    """fp32 bytes of the validation model: the digits MLP with two hidden layers of ``hidden``."""
    return 4 * (64 * hidden + hidden * hidden + hidden * 10 + 2 * hidden + 10)


def fit_link(measured: list[dict[str, object]], collective: str = "allreduce") -> Link:
    """Least-squares α, β over the ring-allreduce (``collective``: the communicator's, or ``group``: plain
    MPI's) and point-to-point times of every measured world."""
    rows, times = [], []
    for m in measured:
        p = int(m["size"])  # type: ignore[arg-type]
        for size, seconds in m["links"][collective]:  # type: ignore[index]
            rows.append([2 * (p - 1), 2 * (p - 1) / p * size])
            times.append(seconds)
        for size, seconds in m["links"]["p2p"]:  # type: ignore[index]
            rows.append([1.0, float(size)])
            times.append(seconds)
    (alpha, beta), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return Link(max(float(alpha), 0.0), max(float(beta), 1e-15))


def validation_rows(measured: list[dict[str, object]], link: Link, group: Link) -> tuple[list[str], float]:
    """Measured vs predicted seconds per step for every rule at every measured size; the worst error."""
    nbytes = model_bytes()
    gamma = statistics.mean(float(m["gamma"]) for m in measured)  # type: ignore[arg-type]
    overlaps = all(bool(m["overlaps"]) for m in measured)
    cores = min(int(m.get("cores", len(os.sched_getaffinity(0)))) for m in measured)  # type: ignore[call-overload]
    here = Cluster(
        "here", gpus_per_node=64, intra=link, inter=link, gamma=gamma, overlaps=overlaps, group=group,
        cores=cores,
    )  # fmt: skip
    rows = ["| rule | ranks | measured ms/step | predicted | predicted ÷ measured |", "|---|---|---|---|---|"]
    worst = 0.0
    for m in measured:
        p, per_step = int(m["size"]), m["per_step"]  # type: ignore[arg-type]
        floor = per_step["floor"]  # type: ignore[index]
        rows.append(f"| (no exchange: the floor) | {p} | {floor * 1e3:.3f} | — | — |")
        for rule in RULES:
            if p < 3 and rule in ("GSP",):  # GSP's groups need workers beside its server
                continue
            predicted = step_time(rule, p, floor, nbytes, here, **HYPER.get(rule, {})).seconds
            got = per_step[rule]  # type: ignore[index]
            worst = max(worst, abs(predicted / got - 1))
            rows.append(f"| {rule} | {p} | {got * 1e3:.3f} | {predicted * 1e3:.3f} | {predicted / got:.2f} |")
    return rows, worst


def shown(path: Path) -> Path:
    """``path`` relative to the repository when inside it (as the results file names files)."""
    full = path.resolve()
    return full.relative_to(REPO) if full.is_relative_to(REPO) else path


def measure_worlds(argv: list[str]) -> list[dict[str, object]] | None:
    """Run the measuring jobs at 2 and 4 ranks; their rank 0's results (None if a job failed)."""
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (2, 4):
            into = Path(tmp) / f"{ranks}.json"
            if relaunch("benchmarks.scaling", ranks, [*argv, "--measure-into", str(into)]):
                return None
            measured.append(json.loads(into.read_text()))
    return measured


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__)
    parser.add_argument(
        "--cluster", type=Path, action="append", help="cluster file(s) (default: both examples)"
    )
    parser.add_argument("--model", default="", help="model of the cluster file's [compute] (default: each)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every rule (median)")
    parser.add_argument("--no-validate", action="store_true", help="skip the measurements on this machine")
    parser.add_argument(
        "--measured", type=Path, help="JSON of an earlier run's measurements: refit without measuring again"
    )
    parser.add_argument("--save-measured", type=Path, help="write this run's measurements (JSON) here")
    parser.add_argument("--measure-into", type=Path, help=argparse.SUPPRESS)  # the MPI jobs' output
    args = parser.parse_args(argv)
    if args.measure_into is not None:
        result = measure_here(args.steps, args.rounds)
        if result["rank"] == 0:
            args.measure_into.write_text(json.dumps(result))
        return 0
    sections = []
    if not args.no_validate:
        measured = json.loads(args.measured.read_text()) if args.measured else measure_worlds(argv)
        if measured is None:
            return 1
        if args.save_measured:
            args.save_measured.write_text(json.dumps(measured))
        link, group = fit_link(measured), fit_link(measured, "group")
        rows, worst = validation_rows(measured, link, group)
        pass_ms = statistics.mean(float(m["gamma"]) for m in measured) * model_bytes() * 1e3
        sections.append(
            f"### Validation on this machine\n\nFitted α = {link.alpha * 1e6:.1f} µs, "
            f"β = {link.beta * 1e9:.3f} ns/B ({1 / link.beta / 1e9:.2f} GB/s); split communicators "
            f"(plain MPI: GSP's groups) α = {group.alpha * 1e6:.1f} µs, {1 / group.beta / 1e9:.2f} GB/s. "
            f"Digits MLP, hidden {HIDDEN}, "
            f"{args.steps} steps per rule, median of {args.rounds} interleaved rounds; one elementwise pass "
            "over "
            f"its parameters γ n = {pass_ms:.3f} ms "
            "(measured); "
            f"the worst |predicted ÷ measured − 1| is {worst:.0%}.\n\n" + "\n".join(rows)
        )
    for path in args.cluster or sorted(CLUSTERS.glob("*.ini")):
        cluster, params, batch = load_cluster(path)
        for model in [args.model] if args.model else sorted(cluster.compute):
            nbytes = 4 * (params.get(model) or zoo_params(model))
            plot(
                cluster,
                model,
                nbytes,
                REPO / "benchmarks" / "results" / f"scaling-{cluster.name}-{model}.png",
            )
            rows = prediction_rows(cluster, model, nbytes, batch)
            sections.append(
                f"### {model} on {cluster.name} ({shown(path)})\n\n{nbytes / 1e6:.0f} MB of "
                f"fp32 parameters, {cluster.compute[model] * 1e3:.0f} ms of compute per step, {batch} per "
                "GPU. Each cell: step time, samples/s, scaling efficiency.\n\n" + "\n".join(rows)
            )
    path = append_result("scaling", "Scaling cost model", "\n\n".join(sections))
    print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
