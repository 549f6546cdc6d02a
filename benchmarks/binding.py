"""Core binding on a compute-bound 2-rank job: no binding vs ``core`` binding vs a deliberately bad binding.

    python -m benchmarks.binding [--size 384] [--matmuls 96] [--repeats 10]
    mpiexec -n 2 python -m benchmarks.binding [...]   # Open MPI: add --bind-to none (it binds by default)

Every rank multiplies float32 matrices (torch.mm) in a loop, with torch threads set to the cores it is given:

* ``none``: every rank may run anywhere; threads = usable cores ÷ ranks on the node (the framework's default);
* ``none-all``: no binding and every rank's torch threads = all usable cores (a common unbound default);
* ``core``: mpicrossbow's ``bind = core`` (disjoint contiguous cores per rank, threads = its cores);
* ``bad``: every rank pinned to the same one core (what a wrong binding or a mis-set cgroup does).

Each round runs the three policies in an order rotated round by round; a sample is the slowest rank's time
for the loop, between barriers. Rank 0 prints medians and ratios and appends them to
benchmarks/results/binding.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.report import append_result, relaunch, under_mpi

POLICIES = ("none", "none-all", "core", "bad")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=384, help="square matrix size")
    parser.add_argument("--matmuls", type=int, default=96, help="matrix products per timed loop")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--ranks", type=int, default=2, help="ranks when re-launching under mpiexec")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not under_mpi():
        return relaunch(__spec__.name, args.ranks, sys.argv[1:])
    import torch
    from mpi4py import MPI

    from mpicrossbow.launch.binding import bind, gather_facts, set_affinity_all_threads, set_threads
    from mpicrossbow.launch.world import detect_world

    world = detect_world()
    comm = world.mpi
    initial = frozenset(os.sched_getaffinity(0))
    facts = gather_facts(world, "cpu")
    if any(f.affinity != facts[0].affinity for f in facts):
        if world.rank == 0:
            print("the MPI launcher bound the ranks already; run with --bind-to none (Open MPI)", flush=True)
        return 2

    def apply(policy: str) -> int:
        set_affinity_all_threads(initial)
        if policy in ("none", "none-all"):
            threads = len(initial) if policy == "none-all" else max(1, len(initial) // world.local_size)
            set_threads(threads)
            return threads
        if policy == "core":
            return bind("core", facts, world.rank, memory=False).threads
        set_affinity_all_threads(frozenset({min(initial)}))
        set_threads(1)
        return 1

    a, b = torch.randn(args.size, args.size), torch.randn(args.size, args.size)
    samples: dict[str, list[float]] = {p: [] for p in POLICIES}
    threads: dict[str, int] = {}
    for round_ in range(args.warmup + args.repeats):
        shift = round_ % len(POLICIES)
        for policy in POLICIES[shift:] + POLICIES[:shift]:
            threads[policy] = apply(policy)
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.matmuls):
                torch.mm(a, b)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if round_ >= args.warmup:
                samples[policy].append(elapsed)
    set_affinity_all_threads(initial)
    if world.rank != 0:
        return 0
    median = {p: statistics.median(s) for p, s in samples.items()}
    flops = 2 * args.size**3 * args.matmuls * world.size
    described = {
        "none": "no binding",
        "none-all": "no binding, threads = all usable cores",
        "core": "bind = core (one core per rank here)",
        "bad": "both ranks pinned to one core",
    }
    rows = [
        "| binding | torch threads per rank | median s | min s | GFLOP/s (all ranks) | median ÷ no binding |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {described[p]} | {threads[p]} | {median[p]:.3f} | {min(samples[p]):.3f} | "
            f"{flops / median[p] / 1e9:.1f} | {median[p] / median['none']:.2f} |"
            for p in POLICIES
        ),
    ]
    summary = (
        f"- {world.size} ranks, {len(initial)} usable cores, {args.matmuls} × torch.mm of {args.size}² "
        f"float32 per sample, {args.repeats} rounds after {args.warmup} warm-up, rotated order\n"
        f"- bad ÷ core: {median['bad'] / median['core']:.2f}; core ÷ no binding: "
        f"{median['core'] / median['none']:.2f}"
    )
    text = "\n".join(rows) + "\n\n" + summary
    print(text, flush=True)
    if not args.no_write:
        print("appended to", append_result("binding", "Core binding, compute-bound 2-rank job", text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
