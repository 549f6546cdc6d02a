"""Learner-pool engines side by side: samples/s of the serial and fused engines against learners per rank.

One process, one rank's view: for each model, learner count m and per-learner batch b, build a SerialPool and
a FusedPool from the same seed, and the bound — one replica at batch m·b, the most that fusing m replicas of
batch b can reach on this device — and time ``compute()`` + ``apply()`` (forward, backward, optimizer step,
batch assembly included) in alternating rounds, so machine noise hits all three alike; report the median
samples/s, fused ÷ serial and fused ÷ bound. Torch threads are set explicitly (1 = one MPI rank's share of a
2-core machine when two ranks run; 2 = the whole machine). ``--device cuda`` runs the grid on the GPU instead
(CUDA synchronised around every timed round), where ``--engines serial,fused,streams`` adds the streams engine
(one CUDA stream per learner) as a column; benchmarks/gpu.sh runs it that way and writes to results/gpu.md
(``--out gpu``). On CUDA every engine's peak GPU memory is measured too (``torch.cuda.max_memory_allocated``
over building the pool and its warm-up steps, less what was allocated before it, reset for every pool), and
a second table gives learners per GPU: m learners' samples/s ÷ one learner's, with those peaks.

``--precisions fp32,bf16`` measures the engines at each ``[optim] precision`` instead (the pools built with
``OptimSection(precision=...)``; bf16 autocast runs on the CPU too): samples/s and the ratio of every
precision to the first, side by side in the same alternating rounds, without the bound.

``--graphs off,on`` (CUDA) measures every engine and the bound without and with CUDA graphs (``[pool]
cuda_graphs``, pools built with ``PoolSpec(cuda_graphs=...)``) in the same alternating rounds: samples/s,
each engine's with ÷ without, fused ÷ bound and streams ÷ serial at each setting (the bound captured too
where the setting is on). One value (``--graphs on``) builds every pool of the other modes with it, e.g.
``--precisions fp32,bf16 --graphs on`` for bf16 ÷ fp32 with graphs. With ``--graphs`` or ``--precisions``
comparing two or more values, ``--engines`` may name any of the engines (the bound is measured in the graphs
comparison whatever they are).

    python -m benchmarks.pool             # full grid, 1 and 2 threads; appends to results/pool.md + PNG
    python -m benchmarks.pool --quick     # m ∈ {1, 8}, batch ∈ {4, 16}, 1 thread, short rounds
    python -m benchmarks.pool --device cuda --engines serial,fused,streams --models resnet50 --out gpu
    python -m benchmarks.pool --device cuda --precisions fp32,bf16 --learners 1,8 --batches 32 --out gpu
    python -m benchmarks.pool --device cuda --engines fused --graphs off,on --models resnet20 --batches 16
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS, add_seconds_argument, append_result, gpu_versions, versions


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small grid, short rounds (a smoke run)")
    parser.add_argument("--learners", default="1,2,4,8,16", help="comma-separated learner counts m")
    parser.add_argument("--batches", default="4,16,64", help="comma-separated per-learner batch sizes")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument(
        "--models",
        default=None,
        help="subset of mlp,lenet8,lenet28,resnet20,mnist1d,transformer,resnet50 (default all but resnet50)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the pools train")
    parser.add_argument(
        "--engines", default="serial,fused", help="comma list of serial,fused,streams (streams: cuda only)"
    )
    parser.add_argument(
        "--precisions",
        default="fp32",
        help="comma list of [optim] precision values (fp32, bf16, fp16); two or more: measure each engine "
        "at each precision, and the ratio to the first, instead of the engine grid",
    )
    parser.add_argument(
        "--graphs",
        default="off",
        help="comma list of [pool] cuda_graphs values (off, on, auto); two or more: measure each engine and "
        "the bound at each, with the ratios, instead of the engine grid; one: build every pool with it",
    )
    parser.add_argument("--out", default="pool", help="results/<OUT>.md to append to (gpu.sh: gpu)")
    parser.add_argument("--rounds", type=int, default=5, help="timed alternating rounds per engine")
    parser.add_argument("--round-seconds", type=float, default=0.5, help="target length of one round")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    add_seconds_argument(
        parser,
        "start no grid point that would end after this many seconds; the table holds the points measured "
        "and names the rest",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.learners, args.batches, args.threads = "1,8", "4,16", "1"
        args.models = args.models or "mlp,lenet8,resnet20"
        args.rounds, args.round_seconds = 3, 0.2
    args.models = args.models or "mlp,lenet8,lenet28,resnet20,mnist1d,transformer"
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not args.precisions or not set(args.precisions) <= set(PRECISIONS):
        parser.error(f"--precisions takes a comma list of {', '.join(PRECISIONS)}; got {args.precisions}")
    if len(set(args.precisions)) != len(args.precisions):
        parser.error(f"--precisions names a precision twice: {args.precisions}")
    args.graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    if not args.graphs or not set(args.graphs) <= set(GRAPHS) or len(set(args.graphs)) != len(args.graphs):
        parser.error(f"--graphs takes a comma list of distinct {', '.join(GRAPHS)}; got {args.graphs}")
    if "on" in args.graphs and args.device != "cuda":
        parser.error("--graphs on needs --device cuda (CUDA graphs capture on CUDA devices only)")
    if len(args.graphs) > 1 and len(args.precisions) > 1:
        parser.error("compare --graphs or --precisions, not both: give the other one value")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    comparing = len(args.precisions) > 1 or len(args.graphs) > 1
    if not args.engines or not set(args.engines) <= set(ENGINES):
        parser.error(f"--engines takes a comma list of {', '.join(ENGINES)}; got {','.join(args.engines)}")
    if not comparing and not {"serial", "fused"} <= set(args.engines):
        parser.error(
            f"--engines must name serial and fused, and may add streams; got {','.join(args.engines)}"
        )
    if "streams" in args.engines and args.device != "cuda":
        parser.error("--engines streams needs --device cuda (the streams engine runs on CUDA devices only)")
    return args


#: Engines this script can time (the bound is always measured: one serial learner at batch m·b).
ENGINES = ("serial", "fused", "streams")
#: ``[optim] precision`` values ``--precisions`` takes.
PRECISIONS = ("fp32", "bf16", "fp16")
#: ``[pool] cuda_graphs`` values ``--graphs`` takes.
GRAPHS = ("off", "on", "auto")


class Deadline:
    """The grid within a time limit: a caller that kills the process at its limit (gpu.sh's steps) would lose
    every point measured, so the grid stops before a point that would not end in time, judged by the longest
    point so far, and the table says which points were left out.

    ``seconds`` counts from the Deadline's making; 0 means no limit. ``margin`` is kept for the table and the
    results file.
    """

    def __init__(self, seconds: float, margin: float = 10.0) -> None:
        self.seconds = seconds
        self.margin = margin
        self.start = time.monotonic()
        self.left_out: list[tuple[int, str, int, int]] = []

    def points(self, points: list[tuple[int, str, int, int]]) -> Iterator[tuple[int, str, int, int]]:
        """Yield the grid's points while the next one, as long as the longest so far, would end in time."""
        longest = 0.0
        for i, point in enumerate(points):
            began = time.monotonic()
            if self.seconds > 0 and began - self.start + 1.25 * longest + self.margin > self.seconds:
                self.left_out = points[i:]
                left = len(self.left_out)
                print(f"time limit of {self.seconds:.0f} s: {left} point(s) left out", flush=True)
                return
            yield point
            longest = max(longest, time.monotonic() - began)

    def note(self) -> str:
        """A paragraph naming the points left out, or "" when the whole grid ran."""
        if not self.left_out:
            return ""
        named = ", ".join(f"{key} m = {m} batch {batch}" for _, key, batch, m in self.left_out)
        return (
            f"\n\nNot measured, the time limit of {self.seconds:.0f} s (`--seconds`, gpu.sh's step limit) "
            f"being near: {named}."
        )


def check_device(device: str) -> None:
    """Exit with one clear line when ``--device cuda`` is asked for on a machine without CUDA."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks.pool: --device cuda needs a CUDA device, and torch.cuda.is_available() is False")


def models() -> dict[str, Any]:
    """Benchmark models by key: (label, model-file object)."""
    from data.synthetic import Synthetic
    from models.lenet import LeNet
    from models.mlp import MLP
    from models.resnet import ResNet20
    from mpicrossbow import Shard

    class SyntheticLeNet(LeNet):
        """LeNet at MNIST size on synthetic 28×28 data (no MNIST files needed)."""

        def data(self, shard: Shard) -> Synthetic:
            return Synthetic(shard, shape=(1, 28, 28), n_train=2048, seed=shard.seed)

    return {
        **plain_models(),
        "resnet50": ("ResNet-50, torchvision layout (synthetic 3×64×64)", resnet50_model()),
        "mlp": ("MLP 64-128-128-10 (digits 8×8)", MLP()),
        "lenet8": ("LeNet (digits 8×8)", LeNet()),
        "lenet28": ("LeNet (synthetic 28×28)", SyntheticLeNet(image_size=28)),
        "resnet20": ("ResNet-20 (synthetic 32×32)", ResNet20()),
    }


def plain_models() -> dict[str, Any]:
    """Plain ``nn.Module`` networks on random data (the vmap path of the fused engine)."""
    import torch

    from models.mnist1d import MNIST1DCNN
    from models.transformer import Tokens, TransformerBlock
    from mpicrossbow.data.arrays import ArrayDataset
    from mpicrossbow.data.dataset_model import DatasetModel
    from mpicrossbow.data.loader import LoaderOptions

    gen = torch.Generator().manual_seed(0)
    signals = [
        ArrayDataset(torch.randn(n, 40, generator=gen), torch.randint(0, 10, (n,)), "random")
        for n in (4096, 64)
    ]
    return {
        "mnist1d": (
            "MNIST-1D CNN (random 40-point signals)",
            DatasetModel(MNIST1DCNN, {}, *signals, LoaderOptions()),
        ),
        "transformer": (
            "Transformer block (random 12-token sequences)",
            DatasetModel(TransformerBlock, {}, Tokens(4096), Tokens(64, seed=1), LoaderOptions()),
        ),
    }


def resnet50_model() -> Any:
    """ResNet-50 in torchvision's layout (models/imagenet_resnet.py, 10 classes), 1,024 random 3×64×64 images.

    64×64 rather than ImageNet's 224: the stem divides by 4, so the four stages see 16, 8, 4 and 2 pixels a
    side (every BatchNorm still over more than one pixel, unlike 32×32 where the last stage is 1×1), and one
    sample costs about 8 % of a 224×224 one, so m = 16 learners × batch 32 = 512 images a step fit the GPU
    tables' time budget and a GPU's memory (16 replicas of 25.5 M parameters, with gradients and momentum,
    are ~5 GB per engine). Its residual ``forward()`` is not a layer the fuser widens: the vmap path.
    """
    import torch

    from models.imagenet_resnet import resnet50
    from mpicrossbow.data.arrays import ArrayDataset
    from mpicrossbow.data.dataset_model import DatasetModel
    from mpicrossbow.data.loader import LoaderOptions

    gen = torch.Generator().manual_seed(0)
    images = [
        ArrayDataset(
            torch.randn(n, 3, 64, 64, generator=gen), torch.randint(0, 10, (n,), generator=gen), "random"
        )
        for n in (1024, 64)
    ]
    return DatasetModel(resnet50, {"num_classes": 10}, *images, LoaderOptions())


@dataclass
class Row:
    """One measured configuration."""

    model: str
    device: str
    threads: int
    m: int
    batch: int
    serial: float
    fused: float
    bound: float
    cpu_ratio: float
    steps: int
    streams: float | None = None
    #: The form the fused engine chose (``[pool] fuse = auto``): fused network or replicas one after another.
    form: str = "fused"
    #: Peak GPU memory in MiB by engine (and "bound"), measured on CUDA only.
    memory: dict[str, float] = field(default_factory=dict)
    #: Fused ÷ bound from this process's CPU time (steadier than wall time on a shared machine).
    bound_cpu_ratio: float = float("nan")

    @property
    def ratio(self) -> float:
        """Fused ÷ serial samples/s."""
        return self.fused / self.serial


def run_steps(pool: Any, steps: int, state: dict[str, int]) -> None:
    """``steps`` training steps of ``pool``, starting a new epoch whenever the shard is used up."""
    for _ in range(steps):
        if state["count"] >= pool.n_batch_train:
            state["epoch"] += 1
            state["count"] = 0
            pool.start_epoch(state["epoch"])
        pool.compute(state["count"])
        pool.apply()
        state["count"] += 1


@dataclass
class Timing:
    """What :func:`time_pools` measured for each pool, by name."""

    #: Median samples/s (learners × batch × steps ÷ a round's wall time).
    rate: dict[str, float]
    #: Median process CPU seconds of a round.
    cpu: dict[str, float]
    #: Steps per timed round.
    steps: int
    #: Peak GPU memory in MiB (CUDA only): the most allocated while the pool was built and warmed up, less
    #: what was allocated before it was built.
    memory: dict[str, float]
    #: The form each fused pool chose (``[pool] fuse = auto``).
    form: dict[str, str]


def optim_for(precision: str) -> Any:
    """The benchmark's SGD recipe at ``precision`` (``[optim] precision``; fp32 leaves it at its default)."""
    from mpicrossbow.config import OptimSection

    extra = {} if precision == "fp32" else {"precision": precision}
    return OptimSection(lr=0.01, momentum=0.9, weight_decay=5e-4, **extra)


#: What :func:`time_pools` builds for one name: engine class, batch per learner, learners, optim, and
#: ``[pool] cuda_graphs``.
Maker = tuple[type, int, int, Any, str]


def warm_up_steps(pool: Any) -> int:
    """Untimed steps before a pool runs as it will: 2, the fused engine's form trial, and with CUDA graphs
    the steps until both graphs are captured (the warm-up steps a capture needs, the capture, one more)."""
    from mpicrossbow.pool.cuda_graphs import WARMUP

    choice = getattr(pool, "choice", None)
    graphs = getattr(pool, "graphs", None)
    captures = WARMUP + 2 if graphs is not None and graphs.enabled else 0
    return 2 + (choice.steps_to_decide if choice is not None else 0) + captures


def time_pools(model: Any, makers: dict[str, Maker], args: argparse.Namespace, device: Any) -> Timing:
    """Build a pool per ``makers`` entry, ``name: (engine class, batch per learner, learners, optim,
    cuda_graphs)``, from the same torch seed, warm each up (:func:`warm_up_steps`: the fused engine until it
    has chosen its form, CUDA graphs until captured), then time them in alternating rounds (the order
    reversed every other round, so machine noise hits them alike)."""
    import torch

    from mpicrossbow.pool import PoolSpec

    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    if cuda:  # the previous point's pools, held by reference cycles, must not count against this one
        gc.collect()
        torch.cuda.empty_cache()
    pools: dict[str, Any] = {}
    states = {name: {"epoch": 0, "count": 0} for name in makers}
    memory: dict[str, float] = {}
    for name, (cls, b, learners, optim, graphs) in makers.items():
        if cuda:
            sync()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(0)
        spec = PoolSpec(0, 1, b, optim, device, seed=0, learners=learners, cuda_graphs=graphs)  # type: ignore[arg-type]
        pools[name] = pool = cls(model, spec)
        pool.start_epoch(0)
        run_steps(pool, warm_up_steps(pool), states[name])
        if cuda:
            sync()
            memory[name] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    # Size a round from the first pool's step time.
    first = next(iter(pools))
    sync()
    t0 = time.perf_counter()
    run_steps(pools[first], 1, states[first])
    sync()
    # Up to 2,000 steps: a round of the MLP's 0.3 ms steps capped at 100 lasted 30 ms, too short to average
    # out another job's time slices on a shared machine.
    steps = max(1, min(2000, round(args.round_seconds / max(time.perf_counter() - t0, 1e-6))))
    order = list(pools)
    times: dict[str, list[float]] = {name: [] for name in order}
    cpu: dict[str, list[float]] = {name: [] for name in order}
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            run_steps(pools[name], steps, states[name])
            sync()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    rate = {name: steps * m * b / statistics.median(times[name]) for name, (_, b, m, _, _) in makers.items()}
    forms = {
        name: getattr(pool.choice, "chosen", None) or "fused"
        for name, pool in pools.items()
        if getattr(pool, "choice", None) is not None
    }
    return Timing(rate, {n: statistics.median(c) for n, c in cpu.items()}, steps, memory, forms)


def engine_classes() -> dict[str, type]:
    """The engines' pool classes by name."""
    from mpicrossbow.pool import FusedPool, SerialPool
    from mpicrossbow.pool.streams import StreamsPool

    return {"serial": SerialPool, "fused": FusedPool, "streams": StreamsPool}


def measure(model: Any, m: int, batch: int, args: argparse.Namespace, device: Any) -> tuple[Timing, float]:
    """Every engine in ``args.engines`` and the bound (one serial learner at batch m·b) at
    ``args.precisions[0]``: their timing, and the CPU-time ratio of serial to fused."""
    engines = engine_classes()
    optim, graphs = optim_for(args.precisions[0]), args.graphs[0]
    makers: dict[str, Maker] = {e: (engines[e], batch, m, optim, graphs) for e in args.engines}
    makers["bound"] = (engines["serial"], m * batch, 1, optim, graphs)
    timing = time_pools(model, makers, args, device)
    return timing, timing.cpu["serial"] / max(timing.cpu["fused"], 1e-9)


def table(rows: list[Row]) -> str:
    """Markdown table of the rows; 'fused ÷ one learner' divides by the serial m = 1 row of that setting.
    Where any row measured the streams engine, two more columns: its samples/s and streams ÷ serial."""
    one = {(r.model, r.device, r.threads, r.batch): r.serial for r in rows if r.m == 1}
    streams = any(r.streams is not None for r in rows)
    lines = [
        "| model | device | threads | m | batch/learner | serial samples/s | fused samples/s "
        "| bound: 1 × batch m·b | fused ÷ serial | by CPU time | fused ÷ bound | by CPU time "
        "| fused ÷ one learner | fused form |"
        + (" streams samples/s | streams ÷ serial |" if streams else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        + ("---:|---:|" if streams else ""),
    ]
    for r in rows:
        base = one.get((r.model, r.device, r.threads, r.batch))
        versus_one = f"{r.fused / base:.2f}" if base else "–"
        extra = ""
        if streams:
            extra = " – | – |" if r.streams is None else f" {r.streams:,.0f} | {r.streams / r.serial:.2f} |"
        lines.append(
            f"| {r.model} | {r.device} | {r.threads} | {r.m} | {r.batch} | {r.serial:,.0f} | {r.fused:,.0f} "
            f"| {r.bound:,.0f} | {r.ratio:.2f} | {r.cpu_ratio:.2f} | {r.fused / r.bound:.2f} "
            f"| {r.bound_cpu_ratio:.2f} | {versus_one} "
            f"| {r.form} |" + extra
        )
    return "\n".join(lines)


def learners_table(rows: list[Row]) -> str:
    """Learners per GPU: each engine's samples/s at m learners ÷ one learner's (the serial engine at m = 1 of
    the same model, threads and batch), with each engine's peak GPU memory at that point ("–" where not
    measured)."""
    one = {(r.model, r.device, r.threads, r.batch): r.serial for r in rows if r.m == 1}
    engines = ["serial", "fused"] + (["streams"] if any(r.streams is not None for r in rows) else [])
    lines = [
        "| model | batch/learner | m | "
        + " | ".join(f"{e} ÷ one learner" for e in engines)
        + " | "
        + " | ".join(f"{e} peak MiB" for e in engines)
        + " | bound peak MiB |",
        "|---|---:|---:|" + "---:|" * (2 * len(engines) + 1),
    ]
    for r in rows:
        base = one.get((r.model, r.device, r.threads, r.batch))
        rates = {"serial": r.serial, "fused": r.fused, "streams": r.streams}
        ratios = [f"{rates[e] / base:.2f}" if base and rates[e] is not None else "–" for e in engines]
        peaks = [f"{r.memory[e]:,.0f}" if e in r.memory else "–" for e in [*engines, "bound"]]
        lines.append(f"| {r.model} | {r.batch} | {r.m} | " + " | ".join(ratios + peaks) + " |")
    return "\n".join(lines)


@dataclass
class PrecisionRow:
    """One engine at one (model, m, batch) point, measured at every precision side by side."""

    model: str
    device: str
    threads: int
    m: int
    batch: int
    engine: str
    #: samples/s by precision.
    rate: dict[str, float]
    #: Peak GPU memory in MiB by precision (CUDA only).
    memory: dict[str, float] = field(default_factory=dict)


def measure_precisions(
    model: Any, m: int, batch: int, args: argparse.Namespace, device: Any
) -> list[PrecisionRow]:
    """Every engine in ``args.engines`` at every precision in ``args.precisions``, in the same alternating
    rounds: one row per engine."""
    engines = engine_classes()
    graphs = args.graphs[0]
    makers: dict[str, Maker] = {
        f"{e}@{p}": (engines[e], batch, m, optim_for(p), graphs)
        for e in args.engines
        for p in args.precisions
    }
    timing = time_pools(model, makers, args, device)
    return [
        PrecisionRow(
            "",
            device.type,
            0,
            m,
            batch,
            e,
            {p: timing.rate[f"{e}@{p}"] for p in args.precisions},
            {p: timing.memory[f"{e}@{p}"] for p in args.precisions if f"{e}@{p}" in timing.memory},
        )
        for e in args.engines
    ]


def precision_table(rows: list[PrecisionRow], precisions: list[str]) -> str:
    """Markdown table: samples/s at every precision, every other precision ÷ the first, peak GPU memory."""
    ref, others = precisions[0], precisions[1:]
    lines = [
        "| model | device | threads | m | batch/learner | engine | "
        + " | ".join(f"{p} samples/s" for p in precisions)
        + " | "
        + " | ".join(f"{p} ÷ {ref}" for p in others)
        + " | "
        + " | ".join(f"{p} peak MiB" for p in precisions)
        + " |",
        "|---|---|---:|---:|---:|---|" + "---:|" * (2 * len(precisions) + len(others)),
    ]
    for r in rows:
        cells = [f"{r.rate[p]:,.0f}" for p in precisions]
        cells += [f"{r.rate[p] / r.rate[ref]:.2f}" for p in others]
        cells += [f"{r.memory[p]:,.0f}" if p in r.memory else "–" for p in precisions]
        lines.append(
            f"| {r.model} | {r.device} | {r.threads} | {r.m} | {r.batch} | {r.engine} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


@dataclass
class GraphsRow:
    """Every engine and the bound at one (model, m, batch) point, measured at every ``--graphs`` setting."""

    model: str
    m: int
    batch: int
    #: samples/s by ``engine@setting`` (``bound@setting`` included).
    rate: dict[str, float]
    #: Peak GPU memory in MiB by ``engine@setting``.
    memory: dict[str, float] = field(default_factory=dict)


def measure_graphs(model: Any, m: int, batch: int, args: argparse.Namespace, device: Any) -> Timing:
    """Every engine in ``args.engines`` and the bound (one serial learner at batch m·b) at every setting in
    ``args.graphs``, at ``args.precisions[0]``, in the same alternating rounds."""
    engines = engine_classes()
    optim = optim_for(args.precisions[0])
    makers: dict[str, Maker] = {}
    for graphs in args.graphs:
        for e in args.engines:
            makers[f"{e}@{graphs}"] = (engines[e], batch, m, optim, graphs)
        makers[f"bound@{graphs}"] = (engines["serial"], m * batch, 1, optim, graphs)
    return time_pools(model, makers, args, device)


def graphs_label(name: str, graphs: str) -> str:
    """A column's name for ``name`` at ``[pool] cuda_graphs = graphs``."""
    return {"off": name, "on": f"{name} with graphs"}.get(graphs, f"{name} (graphs {graphs})")


def graphs_table(rows: list[GraphsRow], engines: list[str], settings: list[str]) -> str:
    """Markdown table: samples/s of every engine and the bound at every setting; each one's last setting ÷
    its first (with ÷ without graphs); fused ÷ bound and, with both engines measured, streams ÷ serial, at
    every setting; the peak GPU memory at the last setting."""
    names = [*engines, "bound"]
    first, last = settings[0], settings[-1]
    heads = [f"{graphs_label(n, g)} samples/s" for n in names for g in settings]
    versus = "with ÷ without graphs" if (first, last) == ("off", "on") else f"graphs {last} ÷ {first}"
    heads += [f"{n} {versus}" for n in names]
    pairs = [("fused", "bound")] if "fused" in engines else []
    pairs += [("streams", "serial")] if {"streams", "serial"} <= set(engines) else []
    heads += [f"{graphs_label(f'{a} ÷ {b}', g)}" for a, b in pairs for g in settings]
    heads += [f"{graphs_label(n, last)} peak MiB" for n in names]
    lines = [
        "| model | m | batch/learner | " + " | ".join(heads) + " |",
        "|---|---:|---:|" + "---:|" * len(heads),
    ]
    for r in rows:
        cells = [f"{r.rate[f'{n}@{g}']:,.0f}" for n in names for g in settings]
        cells += [f"{r.rate[f'{n}@{last}'] / r.rate[f'{n}@{first}']:.2f}" for n in names]
        cells += [f"{r.rate[f'{a}@{g}'] / r.rate[f'{b}@{g}']:.2f}" for a, b in pairs for g in settings]
        cells += [f"{r.memory[f'{n}@{last}']:,.0f}" if f"{n}@{last}" in r.memory else "–" for n in names]
        lines.append(f"| {r.model} | {r.m} | {r.batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main_graphs(
    args: argparse.Namespace,
    catalogue: dict[str, Any],
    points: list[tuple[int, str, int, int]],
    device: Any,
    deadline: Deadline,
) -> int:
    """``--graphs`` with two or more values: every engine and the bound at every setting, the table,
    results/."""
    import torch

    rows: list[GraphsRow] = []
    for threads, key, batch, m in deadline.points(points):
        torch.set_num_threads(threads)
        label, model = catalogue[key]
        timing = measure_graphs(model, m, batch, args, device)
        rows.append(GraphsRow(label, m, batch, timing.rate, timing.memory))
        print(graphs_table(rows[-1:], args.engines, args.graphs).splitlines()[-1], flush=True)
    head = (
        f"Each engine and the bound (one serial learner at batch m·b) with `[pool] cuda_graphs` = "
        f"{', '.join(args.graphs)} (pools built with `PoolSpec(cuda_graphs=...)`: the learner step and the "
        f"optimizer step captured in CUDA graphs and replayed where on), `[optim] precision = "
        f"{args.precisions[0]}`, {args.rounds} alternating timed rounds of about {args.round_seconds} s "
        "(median), after the warm-up steps (the fused engine's form trial, and the steps until both graphs "
        "are captured). samples/s = m × batch × steps ÷ wall time; peak MiB = "
        "torch.cuda.max_memory_allocated over building the pool and its warm-up steps (the graphs' memory "
        "included), less what was allocated before."
    )
    text = head + "\n\n" + graphs_table(rows, args.engines, args.graphs) + deadline.note()
    print(text)
    if not args.no_write:
        where = "GPU" if device.type == "cuda" else "CPU"
        title = f"Pool engines with cuda_graphs = {' vs '.join(args.graphs)}, on the {where} "
        title += f"({', '.join(args.engines)})"
        line = f"{versions()}; {gpu_versions()}" if device.type == "cuda" else None
        print("appended to", append_result(args.out, title, text, versions_line=line))
    return 0


def plot(rows: list[Row], path: Path) -> None:
    """samples/s against m, one panel per model, a line per (engine, batch) at the smallest thread count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r.model for r in rows))
    threads = min(r.threads for r in rows)
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        mine = [r for r in rows if r.model == label and r.threads == threads and r.device == "cpu"]
        for batch in sorted({r.batch for r in mine}):
            pts = sorted((r.m, r.serial, r.fused) for r in mine if r.batch == batch)
            (line,) = ax.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=f"fused, batch {batch}")
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                "s--",
                color=line.get_color(),
                label=f"serial, batch {batch}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("learners m")
        ax.set_ylabel("samples/s")
        ax.set_title(f"{label}, {threads} thread(s)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median_seconds(fn: Any, repeat: int = 30) -> float:
    """Median process CPU time of ``fn()`` over ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def forward_paths(catalogue: dict[str, Any], m: int = 8, rounds: int = 5) -> str:
    """The fused engine's two paths for a network the layer fuser cannot widen, side by side.

    Its own ``forward()`` on every replica's values (the default) against ``torch.func.vmap`` over the
    replicas (what it falls back to), each pinned (``fuse = replicated`` / ``vmapped``), alternating rounds of
    20 steps on one thread; median samples/s.
    """
    import torch

    from mpicrossbow.config import OptimSection
    from mpicrossbow.pool import FusedPool, PoolSpec

    lines = [
        f"The fused engine's paths for any network, m = {m}, 1 thread ({rounds} alternating rounds of 20 "
        "steps, median samples/s):",
        "",
        "| model | batch/learner | own forward on every replica's values | torch.func.vmap | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    torch.set_num_threads(1)
    for key in ("mnist1d", "transformer"):
        label, model = catalogue[key]
        for batch in (4, 16):
            pools = {}
            for name, path in (("replicated", "replicated"), ("vmap", "vmapped")):
                torch.manual_seed(0)
                spec = PoolSpec(0, 1, batch, OptimSection(lr=0.01, momentum=0.9), torch.device("cpu"),
                                learners=m, fuse=path)  # fmt: skip
                pools[name] = FusedPool(model, spec)
                pools[name].start_epoch(0)
            states = {name: {"epoch": 0, "count": 0} for name in pools}
            times: dict[str, list[float]] = {name: [] for name in pools}
            for r in range(rounds + 1):
                for name in pools if r % 2 == 0 else list(pools)[::-1]:
                    t0 = time.perf_counter()
                    run_steps(pools[name], 20, states[name])
                    if r:  # the first round warms up
                        times[name].append(time.perf_counter() - t0)
            rate = {name: 20 * m * batch / statistics.median(t) for name, t in times.items()}
            lines.append(
                f"| {label} | {batch} | {rate['replicated']:,.0f} | {rate['vmap']:,.0f} "
                f"| {rate['replicated'] / rate['vmap']:.2f} |"
            )
    return "\n".join(lines)


def layout_costs(catalogue: dict[str, Any], m: int = 8, batch: int = 16) -> str:
    """What the fused pool's strided views cost against the copy-in/copy-out alternative, per step.

    Views: the only extra work is reshaping every grouped convolution's ``(m, out, …)`` weight view to
    ``(m·out, …)`` in forward (a copy), measured directly. Copy-in/out: a fused module with its own
    contiguous weights must copy the m replicas' gradients out before the rule's hooks and the parameters
    back in after them (at least two ``(m, P)`` copies per step, three for rules that read the weights
    before the step).
    """
    import torch

    from mpicrossbow.config import OptimSection
    from mpicrossbow.pool import FusedPool, PoolSpec
    from mpicrossbow.pool.fused.fused_network import FusedConv2d

    lines = [
        f"Layout costs at m = {m}, batch {batch}/learner, 1 thread (median CPU time per step):",
        "",
        "| model | fused step | views: conv weight reshapes | copy-in/out: 2 × (m, P) copies |",
        "|---|---:|---:|---:|",
    ]
    torch.set_num_threads(1)
    for key in ("mlp", "resnet20"):
        label, model = catalogue[key]
        torch.manual_seed(0)
        pool = FusedPool(
            model, PoolSpec(0, 1, batch, OptimSection(lr=0.01, momentum=0.9), torch.device("cpu"), learners=m)
        )
        state = {"epoch": 0, "count": 0}
        pool.start_epoch(0)
        step = median_seconds(lambda pool=pool, state=state: run_steps(pool, 1, state), repeat=10)
        convs = [mod for mod in pool.fused.modules() if isinstance(mod, FusedConv2d)]
        reshape = median_seconds(
            lambda convs=convs: [c.weight.reshape(-1, *c.weight.shape[2:]) for c in convs]
        )
        out, back = torch.empty_like(pool.params2d), pool.params2d.clone()
        copies = median_seconds(lambda p=pool, o=out, b=back: (o.copy_(p.grads2d), p.params2d.copy_(b)))
        lines.append(
            f"| {label} | {step * 1e3:.2f} ms | {reshape * 1e3:.3f} ms ({reshape / step:.1%}) "
            f"| {copies * 1e3:.3f} ms ({copies / step:.1%}) |"
        )
    return "\n".join(lines)


def main() -> int:
    """Measure the grid, print the table, append it to results/<out>.md and (CPU rows) draw the PNG."""
    args = parse_args(sys.argv[1:])
    deadline = Deadline(args.seconds)
    check_device(args.device)
    import torch

    catalogue = models()
    wanted = args.models.split(",")
    unknown = [k for k in wanted if k not in catalogue]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; choose from {', '.join(catalogue)}")
    learners = [int(v) for v in args.learners.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    device = torch.device(args.device)
    thread_counts = [int(v) for v in args.threads.split(",")] if device.type == "cpu" else [1]
    points = [
        (threads, key, batch, m) for threads in thread_counts for key in wanted for batch in batches
        for m in learners
    ]  # fmt: skip
    if len(args.precisions) > 1:
        return main_precisions(args, catalogue, points, device, deadline)
    if len(args.graphs) > 1:
        return main_graphs(args, catalogue, points, device, deadline)
    rows: list[Row] = []
    for threads, key, batch, m in deadline.points(points):
        torch.set_num_threads(threads)
        label, model = catalogue[key]
        timing, cpu_ratio = measure(model, m, batch, args, device)
        rate = timing.rate
        row = Row(label, device.type, threads, m, batch, rate["serial"], rate["fused"], rate["bound"],
                  cpu_ratio, timing.steps, rate.get("streams"), timing.form["fused"],
                  timing.memory, timing.cpu["bound"] / max(timing.cpu["fused"], 1e-9))  # fmt: skip
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    extra = "\n\n" + layout_costs(catalogue) + "\n\n" + forward_paths(catalogue)
    text = table(rows) + deadline.note() + (extra if device.type == "cpu" and not args.quick else "")
    if device.type == "cuda":
        text += (
            "\n\nLearners per GPU: samples/s at m learners ÷ one learner's (the serial engine at m = 1, same "
            "batch); peak MiB = torch.cuda.max_memory_allocated over building the engine's pool and its "
            "warm-up steps (the fused engine's trial of both forms included), less what was allocated "
            "before, reset for every pool.\n\n" + learners_table(rows)
        )
    print(text)
    if not args.no_write:
        write(rows, text, args)
    return 0


def main_precisions(
    args: argparse.Namespace,
    catalogue: dict[str, Any],
    points: list[tuple[int, str, int, int]],
    device: Any,
    deadline: Deadline,
) -> int:
    """``--precisions`` with two or more values: every engine at every precision, the table, results/."""
    import torch

    rows: list[PrecisionRow] = []
    for threads, key, batch, m in deadline.points(points):
        torch.set_num_threads(threads)
        label, model = catalogue[key]
        for row in measure_precisions(model, m, batch, args, device):
            row.model, row.threads = label, threads
            rows.append(row)
            print(precision_table([row], args.precisions).splitlines()[-1], flush=True)
    tf32 = getattr(optim_for("fp32"), "tf32", None)
    head = (
        f"Each engine with `[optim] precision` = {', '.join(args.precisions)} (pools built with "
        "`OptimSection(precision=...)`: autocast around the learners' forward, weights, gradients and "
        f"optimizer state in fp32), {args.rounds} alternating timed rounds of about {args.round_seconds} s "
        "(median), after 2 warm-up steps (the fused engine's until it has chosen its form). samples/s = m × "
        "batch × steps ÷ wall time; peak MiB (CUDA only) = torch.cuda.max_memory_allocated over building the "
        "pool and its warm-up steps, less what was allocated before"
        + (f"; on CUDA fp32 runs with `[optim] tf32 = {str(tf32).lower()}`" if tf32 is not None else "")
        + f"; `[pool] cuda_graphs = {args.graphs[0]}`."
    )
    text = head + "\n\n" + precision_table(rows, args.precisions) + deadline.note()
    print(text)
    if not args.no_write:
        where = "GPU" if device.type == "cuda" else "CPU"
        title = f"Pool engines at {' vs '.join(args.precisions)}, on the {where}"
        if args.graphs[0] != "off":
            title += f", cuda_graphs = {args.graphs[0]}"
        line = f"{versions()}; {gpu_versions()}" if device.type == "cuda" else None
        print("appended to", append_result(args.out, title, text, versions_line=line))
    return 0


def write(rows: list[Row], text: str, args: argparse.Namespace) -> None:
    """Append the table to results/<out>.md (the GPU's name and CUDA versions with CUDA rows); draw the PNG
    of CPU rows."""
    head = (
        f"{args.rounds} alternating timed rounds per engine (median) of about {args.round_seconds} s "
        "each, after 2 warm-up steps (the fused engine's until it has chosen its form, "
        "[pool] fuse = auto); one step = every learner's batch assembly, forward, backward and SGD "
        "step "
        "(momentum 0.9, weight decay 5e-4). samples/s = m × batch × steps ÷ wall time; each 'by CPU time' is "
        "the ratio before it from this process's CPU time, which other jobs on a shared machine disturb less."
    )
    title = "Serial vs fused learner pool" + (" (--quick)" if args.quick else "")
    if args.device == "cuda":
        title = f"{title}, on the GPU ({', '.join(args.engines)})"
        path = append_result(
            args.out, title, head + "\n\n" + text, versions_line=f"{versions()}; {gpu_versions()}"
        )
        print("appended to", path)
        return
    gpu = "CPU rows; `--device cuda` (benchmarks/gpu.sh) measures the engines, streams included, on a GPU."
    png = RESULTS / (f"{args.out}-quick.png" if args.quick else f"{args.out}.png")
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(rows, png)
    path = append_result(args.out, title, head + "\n\n" + text, f"{gpu}\n\nPlot: `{png.name}`.")
    print("appended to", path, "and drew", png)


if __name__ == "__main__":
    sys.exit(main())
