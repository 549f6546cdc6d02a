"""What RULE=AUTO's own work costs a run: its decisions and its per-step bookkeeping, apart from the exchange
of the rule it runs.

On 2 local ranks the MNIST-1D job of benchmarks/links.py (launch/mnist1d.cfg with its recipe, one learner a
rank, one thread) runs under ``RULE=AUTO``; each rank wraps AUTO's hooks and every candidate rule's in a
timer. AUTO's bookkeeping is the time in its ``on_gradients`` and ``exchange`` less the time in the running
rule's own (the exchange itself, which the rule would cost without AUTO); its decisions are the time in
``_decide`` (the link and γ measured, the figures agreed over the ranks, the choice, a move to another rule).
Appends the largest over the ranks, per seed, beside the run's training seconds, to
``benchmarks/results/auto_cost.md``.

    python -m benchmarks.auto_cost [--seeds 0,1,2] [--epochs 30] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report import REPO, append_result, relaunch
from benchmarks.sma_recipe import CFG_RECIPE
from mpicrossbow.training.reporting.metrics import read_metrics

#: 2 ranks: one a core here.
RANKS = 2
#: The run's overrides besides the seed and epochs: benchmarks/links.py's MNIST-1D job on local ranks.
OVERRIDES = ("RULE=AUTO", "session.threads=1", "pool.learners=1", "session.log_level=warning", *CFG_RECIPE)


def _timed(cls: type, name: str, seconds: dict[str, float]) -> None:
    """Replace ``cls.name`` by a wrapper that adds its wall seconds to ``seconds["<class>.<name>"]``."""
    inner: Callable[..., Any] = getattr(cls, name)
    key = f"{cls.__name__}.{name}"
    seconds[key] = 0.0

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - before

    setattr(cls, name, wrapper)


def rank_side(out: Path, overrides: list[str]) -> int:
    """One rank: time AUTO's hooks and the candidates', run crossbow-launch's job, write the figures to
    ``out/rank-<r>.json``."""
    from mpi4py import MPI

    from mpicrossbow import cli
    from mpicrossbow.rules import BSP, SMA, LocalSGD
    from mpicrossbow.rules.auto import Auto

    seconds: dict[str, float] = {}
    for name in ("on_gradients", "exchange", "_decide"):
        _timed(Auto, name, seconds)
    for cls in (BSP, SMA, LocalSGD):
        for name in ("on_gradients", "exchange"):
            _timed(cls, name, seconds)
    status = cli.main(["-cfg", str(REPO / "launch" / "mnist1d.cfg"), *overrides])
    inner = sum(s for key, s in seconds.items() if not key.startswith("Auto."))
    hooks = seconds["Auto.on_gradients"] + seconds["Auto.exchange"]
    figures = {
        "decisions_s": seconds["Auto._decide"],
        "bookkeeping_s": hooks - inner - seconds["Auto._decide"],
    }
    (out / f"rank-{MPI.COMM_WORLD.rank}.json").write_text(json.dumps(figures), encoding="utf-8")
    return status


def run(seed: int, epochs: int, folder: Path) -> dict[str, Any]:
    """One AUTO run at ``seed``: the largest of each figure over the ranks, the decisions made and the run's
    training seconds."""
    folder.mkdir(parents=True)
    overrides = [*OVERRIDES, f"session.seed={seed}", f"session.epochs={epochs}", f"session.output={folder}"]
    status = relaunch("benchmarks.auto_cost", RANKS, ["--rank-side", str(folder), "--", *overrides], 900)
    if status != 0:
        raise RuntimeError(f"seed {seed}: the job exited with {status}")
    ranks = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("rank-*.json"))]
    (path,) = folder.glob("*/metrics.h5")
    metrics = read_metrics(path)
    attrs = metrics["attrs"]
    return {
        "decisions_s": max(r["decisions_s"] for r in ranks),
        "bookkeeping_s": max(r["bookkeeping_s"] for r in ranks),
        "train_s": float(attrs["train_seconds"]),
        "steps": int(metrics["train"]["step"][-1]),
        "choices": str(attrs.get("rule_auto_choice", "")),
    }


def main() -> int:
    """Run each seed, print and append the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--rank-side", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side is not None:
        return rank_side(args.rank_side, args.overrides)
    lines = [
        "| seed | steps | AUTO's choice | training s | decisions ms | bookkeeping ms | both ÷ training |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            r = run(seed, args.epochs, Path(tmp) / f"seed{seed}")
            share = (r["decisions_s"] + r["bookkeeping_s"]) / r["train_s"]
            lines.append(
                f"| {seed} | {r['steps']:,} | {r['choices']} | {r['train_s']:.2f} | "
                f"{r['decisions_s'] * 1e3:.2f} | {r['bookkeeping_s'] * 1e3:.1f} | {share:.2%} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + (
        f"\n\n{RANKS} local ranks, MNIST-1D ({args.epochs} epochs, one learner and one thread a rank), "
        "RULE=AUTO with its default candidates: the largest over the ranks of the seconds in AUTO's "
        "decisions and of its hooks' time less the running rule's own hooks."
    )
    if not args.no_write:
        print("appended to", append_result("auto_cost", "RULE=AUTO's own cost", text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
