"""What ``[session] timeline`` costs: the digits job's training time with the timeline off and recording every
step, side by side in one MPI job, for BSP and GOSGD.

    python -m benchmarks.timeline [--ranks 2] [--rounds 5] [--steps 400]

Each round trains the default digits job (launch/digits.cfg) for ``--steps`` steps once with
``timeline = 0`` and once with ``timeline = steps - 1`` (the whole run after the warm-up step), in an order
that alternates round by round; a sample is ``RunResult.train_seconds`` (the training loop's time, validation
left out) on rank 0. The table gives the median of each and their ratio. Results are appended to
benchmarks/results/timeline.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from benchmarks.report import append_result, relaunch, under_mpi

RULES = ("BSP", "GOSGD")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[tuple[str, bool], list[float]]:
    """Every rank trains every run; rank 0's train_seconds per (rule, timeline on)."""
    from mpicrossbow.config import load_config
    from mpicrossbow.training.run.runner import prepare_session, train

    samples: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as out:
        for round_ in range(args.rounds):
            for rule in RULES:
                for on in (round_ % 2 == 0, round_ % 2 == 1):
                    overrides = [
                        f"RULE={rule}",
                        f"session.steps={args.steps}",
                        f"session.timeline={args.steps - 1 if on else 0}",
                        "session.validate_every=0",
                        "session.progress=off",
                        "session.log_level=warning",
                        f"session.output={out}",
                    ]
                    world, session, code = prepare_session(load_config("launch/digits.cfg", overrides))
                    if code:
                        sys.exit(code)
                    samples.setdefault((rule, on), []).append(train(world, session).train_seconds)
    return samples


def off_cost_per_step() -> float:
    """Seconds the recorder's calls of one training step cost when the timeline is off."""
    import timeit

    from mpicrossbow.trace import complete, span

    def one_step() -> None:
        with span("forward+backward", "compute", step=1):
            pass
        complete("on_gradients", "exchange", 0.0, 0.0)
        with span("optimizer step", "compute"):
            pass
        complete("exchange", "exchange", 0.0, 0.0)
        complete("data wait", "data", 0.0, 0.0, track="data")

    n = 1_000_000
    empty = timeit.timeit(lambda: None, number=n)
    return max(0.0, timeit.timeit(one_step, number=n) - empty) / n


def main(argv: list[str]) -> int:
    args = parse(argv)
    if not under_mpi():
        return relaunch("benchmarks.timeline", args.ranks, argv)
    samples = measure(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank != 0:
        return 0
    rows = ["| rule | off: s (median) | on: s (median) | on ÷ off |", "|---|---|---|---|"]
    for rule in RULES:
        off, on = statistics.median(samples[(rule, False)]), statistics.median(samples[(rule, True)])
        rows.append(f"| {rule} | {off:.3f} | {on:.3f} | {on / off:.3f} |")
    per_step = off_cost_per_step()
    step_s = statistics.median(samples[("BSP", False)]) / args.steps
    notes = (
        f"{args.ranks} ranks, {args.steps} steps of the digits MLP (batch 16), {args.rounds} rounds "
        "alternating the order; on = every step after the first recorded. Off, the instrumented places of "
        f"one BSP step (two spans, two timed calls, one data wait) cost {per_step * 1e9:.0f} ns together "
        f"(timeit, 10^6 calls each): {per_step / step_s:.2%} of the digits step ({step_s * 1e3:.3f} ms)."
    )
    path = append_result("timeline", "Timeline overhead, digits job", "\n".join(rows), notes)
    print("\n".join(rows) + f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
