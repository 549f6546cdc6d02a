"""launch/failure.py: a rank that aborts the job is gone even when MPI_Abort cannot finish."""

from __future__ import annotations

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
