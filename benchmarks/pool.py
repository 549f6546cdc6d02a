"""Learner-pool engines side by side: samples/s of the serial and fused engines against learners per rank.

One process, one rank's view: for each model, learner count m and per-learner batch b, build a SerialPool and
a FusedPool from the same seed, and the bound — one replica at batch m·b, the most that fusing m replicas of
batch b can reach on this device — and time ``compute()`` + ``apply()`` (forward, backward, optimizer step,
batch assembly included) in alternating rounds, so machine noise hits all three alike; report the median
samples/s, fused ÷ serial and fused ÷ bound. Torch threads are set explicitly (1 = one MPI rank's share of a
2-core machine when two ranks run; 2 = the whole machine). ``--device cuda`` runs the grid on the GPU instead
(CUDA synchronised around every timed round), where ``--engines serial,fused,streams`` adds the streams engine
(one CUDA stream per learner) as a column; benchmarks/gpu.sh runs it that way and writes to results/gpu.md
(``--out gpu``).

    python -m benchmarks.pool             # full grid, 1 and 2 threads; appends to results/pool.md + PNG
    python -m benchmarks.pool --quick     # m ∈ {1, 8}, batch ∈ {4, 16}, 1 thread, short rounds
    python -m benchmarks.pool --device cuda --engines serial,fused,streams --models resnet50 --out gpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS, append_result, gpu_versions, versions


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
    parser.add_argument("--out", default="pool", help="results/<OUT>.md to append to (gpu.sh: gpu)")
    parser.add_argument("--rounds", type=int, default=5, help="timed alternating rounds per engine")
    parser.add_argument("--round-seconds", type=float, default=0.5, help="target length of one round")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    if args.quick:
        args.learners, args.batches, args.threads = "1,8", "4,16", "1"
        args.models = args.models or "mlp,lenet8,resnet20"
        args.rounds, args.round_seconds = 3, 0.2
    args.models = args.models or "mlp,lenet8,lenet28,resnet20,mnist1d,transformer"
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not {"serial", "fused"} <= set(args.engines) <= set(ENGINES):
        parser.error(
            f"--engines must name serial and fused, and may add streams; got {','.join(args.engines)}"
        )
    if "streams" in args.engines and args.device != "cuda":
        parser.error("--engines streams needs --device cuda (the streams engine runs on CUDA devices only)")
    return args


#: Engines this script can time (the bound is always measured: one serial learner at batch m·b).
ENGINES = ("serial", "fused", "streams")


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


def measure(
    model: Any, m: int, batch: int, args: argparse.Namespace, device: Any
) -> tuple[dict[str, float], float, int, str]:
    """Median samples/s of every engine in ``args.engines`` and of the bound (by name) over alternating
    rounds, the CPU-time ratio of serial to fused, steps per round, the form the fused engine chose."""
    import torch

    from mpicrossbow.config import OptimSection
    from mpicrossbow.pool import FusedPool, PoolSpec, SerialPool
    from mpicrossbow.pool.streams import StreamsPool

    optim = OptimSection(lr=0.01, momentum=0.9, weight_decay=5e-4)
    pools = {}
    engines = {"serial": SerialPool, "fused": FusedPool, "streams": StreamsPool}
    for name, cls, b, learners in [*((e, engines[e], batch, m) for e in args.engines),
                                   ("bound", SerialPool, m * batch, 1)]:  # fmt: skip
        torch.manual_seed(0)
        pools[name] = cls(model, PoolSpec(0, 1, b, optim, device, seed=0, learners=learners))
        pools[name].start_epoch(0)
    states = {name: {"epoch": 0, "count": 0} for name in pools}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # Warm up every pool (the fused engine until it has chosen its form), and size a round from the serial
    # engine's step time.
    for name, pool in pools.items():
        choice = getattr(pool, "choice", None)
        run_steps(pool, 2 + (choice.steps_to_decide if choice is not None else 0), states[name])
    sync()
    t0 = time.perf_counter()
    run_steps(pools["serial"], 1, states["serial"])
    sync()
    steps = max(1, min(100, round(args.round_seconds / max(time.perf_counter() - t0, 1e-6))))
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
    n = steps * m * batch
    cpu_ratio = statistics.median(cpu["serial"]) / max(statistics.median(cpu["fused"]), 1e-9)
    rate = {name: n / statistics.median(times[name]) for name in order}
    return rate, cpu_ratio, steps, pools["fused"].choice.chosen or "fused"


def table(rows: list[Row]) -> str:
    """Markdown table of the rows; 'fused ÷ one learner' divides by the serial m = 1 row of that setting.
    Where any row measured the streams engine, two more columns: its samples/s and streams ÷ serial."""
    one = {(r.model, r.device, r.threads, r.batch): r.serial for r in rows if r.m == 1}
    streams = any(r.streams is not None for r in rows)
    lines = [
        "| model | device | threads | m | batch/learner | serial samples/s | fused samples/s "
        "| bound: 1 × batch m·b | fused ÷ serial | by CPU time | fused ÷ bound | fused ÷ one learner "
        "| fused form |" + (" streams samples/s | streams ÷ serial |" if streams else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|" + ("---:|---:|" if streams else ""),
    ]
    for r in rows:
        base = one.get((r.model, r.device, r.threads, r.batch))
        versus_one = f"{r.fused / base:.2f}" if base else "–"
        extra = ""
        if streams:
            extra = " – | – |" if r.streams is None else f" {r.streams:,.0f} | {r.streams / r.serial:.2f} |"
        lines.append(
            f"| {r.model} | {r.device} | {r.threads} | {r.m} | {r.batch} | {r.serial:,.0f} | {r.fused:,.0f} "
            f"| {r.bound:,.0f} | {r.ratio:.2f} | {r.cpu_ratio:.2f} | {r.fused / r.bound:.2f} | {versus_one} "
            f"| {r.form} |" + extra
        )
    return "\n".join(lines)


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
    replicas (what it falls back to), both fused (``fuse = always``), alternating rounds of 20 steps on one
    thread; median samples/s.
    """
    import torch

    from mpicrossbow.config import OptimSection
    from mpicrossbow.pool import FusedPool, PoolSpec
    from mpicrossbow.pool.vmapped import VmappedNetwork

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
            for name in ("replicated", "vmap"):
                torch.manual_seed(0)
                spec = PoolSpec(0, 1, batch, OptimSection(lr=0.01, momentum=0.9), torch.device("cpu"),
                                learners=m, fuse="always")  # fmt: skip
                pools[name] = FusedPool(model, spec)
                pools[name].start_epoch(0)
            pools["vmap"].fused.fallback = VmappedNetwork(pools["vmap"].fused.root, pools["vmap"].fused.slots)
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
    from mpicrossbow.pool.fuse import FusedConv2d

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
    rows: list[Row] = []
    thread_counts = [int(v) for v in args.threads.split(",")] if device.type == "cpu" else [1]
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for key in wanted:
            label, model = catalogue[key]
            for batch in batches:
                for m in learners:
                    rate, cpu_ratio, steps, form = measure(model, m, batch, args, device)
                    row = Row(label, device.type, threads, m, batch, rate["serial"], rate["fused"],
                              rate["bound"], cpu_ratio, steps, rate.get("streams"), form)  # fmt: skip
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
    extra = "\n\n" + layout_costs(catalogue) + "\n\n" + forward_paths(catalogue)
    text = table(rows) + (extra if device.type == "cpu" and not args.quick else "")
    print(text)
    if not args.no_write:
        write(rows, text, args)
    return 0


def write(rows: list[Row], text: str, args: argparse.Namespace) -> None:
    """Append the table to results/<out>.md (the GPU's name and CUDA versions with CUDA rows); draw the PNG
    of CPU rows."""
    head = (
        f"{args.rounds} alternating timed rounds per engine (median) of about {args.round_seconds} s "
        "each, after 2 warm-up steps (the fused engine's until it has chosen its form, "
        "[pool] fuse = auto); one step = every learner's batch assembly, forward, backward and SGD "
        "step "
        "(momentum 0.9, weight decay 5e-4). samples/s = m × batch × steps ÷ wall time; 'by CPU time' is "
        "the same ratio from this process's CPU time, which other jobs on a shared machine disturb less."
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
