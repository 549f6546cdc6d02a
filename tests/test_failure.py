"""launch/failure.py: a rank that aborts the job is gone even when MPI_Abort cannot finish."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import REPO

#: A rank whose MPI_Abort never returns (a launcher that cannot reach a lost node), aborting with status 7.
STUCK_ABORT = """
import threading, time
from mpicrossbow.launch import failure
from mpicrossbow.launch.world import World

class StuckMpi:
    def Abort(self, code):
        threading.Event().wait()

failure.ABORT_DEADLINE_S = 0.5
world = World(rank=1, size=4, local_rank=1, local_size=2, node=0, nodes=2, hostname="h", launcher="srun",
              mpi=StuckMpi())
failure.abort_job(world, "rank 2 on node2 is gone; rank 1 aborts the job", code=7, record=False)
"""


def test_a_rank_whose_mpi_abort_hangs_ends_itself_with_the_job_status() -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", STUCK_ABORT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 7, proc.stderr
    line = "crossbow-launch: error: rank 2 on node2 is gone; rank 1 aborts the job"
    assert proc.stderr.splitlines() == [line]
    assert time.monotonic() - started < 30


#: A one-rank job (no MPI_Abort) whose torch.distributed group is up when it fails; atexit says whether the
#: group was still there when the interpreter began to exit. HANG=1: destroying the group never returns.
ONE_RANK_WITH_A_GROUP = """
import atexit, os, sys, tempfile, threading
import torch.distributed as dist
from mpicrossbow.launch import failure
from mpicrossbow.launch.world import World

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
if os.environ.get("HANG") == "1":
    failure.ABORT_DEADLINE_S = 0.5
    dist.destroy_process_group = lambda *a, **k: threading.Event().wait()
atexit.register(lambda: print("group at exit:", dist.is_initialized(), flush=True))
world = World(rank=0, size=1, local_rank=0, local_size=1, node=0, nodes=1, hostname="h", launcher="mpiexec",
              mpi=None)
failure.abort_job(world, "rank 0 of 1 failed", code=3, record=False)
"""


def test_a_one_rank_failure_destroys_its_process_group_before_exiting() -> None:
    """An NCCL group left for interpreter exit kept a failed one-rank job alive on a GPU until it was killed;
    the group is destroyed first (Gloo here: the same call), and the job status is kept."""
    proc = subprocess.run(
        [sys.executable, "-c", ONE_RANK_WITH_A_GROUP], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    assert "group at exit: False" in proc.stdout, proc.stdout + proc.stderr


def test_a_group_that_cannot_be_destroyed_does_not_hold_the_rank() -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", ONE_RANK_WITH_A_GROUP],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HANG": "1"},
    )
    assert proc.returncode == 3, proc.stderr
    assert "crossbow-launch: error: rank 0 of 1 failed" in proc.stderr
    assert time.monotonic() - started < 30
