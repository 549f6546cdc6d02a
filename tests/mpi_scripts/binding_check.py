"""Under mpiexec: bind in each mode given, record what was reported and what the kernel enforces.

Usage: binding_check.py OUT_DIR MODE[,MODE...]. Between modes every rank returns to the mask it started with,
so each mode starts from the launcher's state. Writes OUT_DIR/rank<R>.json.
"""

import json
import os
import sys
from pathlib import Path

import torch

from mpicrossbow.launch.binding import bind, gather_facts, report, set_affinity_all_threads
from mpicrossbow.launch.topology import parse_cpulist
from mpicrossbow.launch.world import detect_world
from mpicrossbow.log import setup_logging

out, modes = Path(sys.argv[1]), sys.argv[2].split(",")
world = detect_world()
setup_logging(world.rank, world.size)
initial = frozenset(os.sched_getaffinity(0))
results = {}
for mode in modes:
    set_affinity_all_threads(initial)
    world.mpi.Barrier()
    binding = bind(mode, gather_facts(world, "cpu"), world.rank)
    report(world, binding)
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        threads[tid] = sorted(parse_cpulist(line.split(":", 1)[1]))
    results[mode] = {
        "reported": list(binding.cpus),
        "source": binding.source,
        "threads": binding.threads,
        "affinity": sorted(os.sched_getaffinity(0)),
        "thread_affinities": list(threads.values()),
        "torch_threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }
    world.mpi.Barrier()
(out / f"rank{world.rank}.json").write_text(json.dumps(results))
