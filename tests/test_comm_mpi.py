"""MPICommunicator's own behaviour under a real ``mpiexec`` (its Communicator contract is
tests/test_communicator_contract.py's), and the backend factory's checks of its input.

Starting torch in an MPI rank costs seconds, so the MPI-specific checks (tests/mpi_scripts/mpi_check.py) run
in the shared communicator job of each world size; rank 0 prints one line per check.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from conftest import COMM_JOB_SIZES, REPO, CommJob, mpi_env
from mpicrossbow.comm import BACKENDS, agreed_backend, make_communicator, resolve_backend
from mpicrossbow.config import CommSection, load_config
from mpicrossbow.errors import ConfigError


@pytest.mark.mpi
@pytest.mark.parametrize("n", COMM_JOB_SIZES)
def test_mpi_specific_checks_under_mpiexec(comm_job: Callable[[int], CommJob], n: int) -> None:
    """MPI is handed the tensors' own memory; the factory and the CUDA-awareness switch choose as
    documented."""
    job = comm_job(n)
    found = job.verdicts("mpi_check")
    failed = [f"{c}: {found.get(c, 'not reported')}" for c in ("buffers", "factory") if found.get(c) != "OK"]
    assert not failed, "\n".join(failed) + job.tail()


def test_backend_names() -> None:
    """The valid names, and what ``auto`` means on each device."""
    assert BACKENDS == ("auto", "mpi", "gloo", "nccl")
    assert resolve_backend("auto", torch.device("cpu")) == "mpi"
    assert resolve_backend("auto", "cuda:1") == "nccl"
    assert resolve_backend("gloo", "cpu") == "gloo"


def test_cpu_server_ranks_beside_gpu_workers_agree_on_mpi() -> None:
    """DEVICES=cpu,cuda0,...: NCCL cannot reach the CPU ranks, so ``auto`` is mpi on every rank; ranks that
    agree keep their device's backend, and an explicit choice stands (checked per device as before)."""
    assert agreed_backend("auto", ["cpu", "cuda", "cuda"]) == "mpi"
    assert agreed_backend("auto", ["cuda", "cuda"]) == "nccl"
    assert agreed_backend("auto", ["cpu", "cpu"]) == "mpi"
    assert agreed_backend("gloo", ["cpu", "cuda"]) == "gloo"
    with pytest.raises(ConfigError, match="nccl needs a CUDA device"):
        agreed_backend("nccl", ["cpu", "cuda"])


def test_unknown_backend_is_a_config_error() -> None:
    """An unknown name raises ConfigError listing the valid ones, before touching MPI."""
    with pytest.raises(ConfigError, match="auto, mpi, gloo, nccl"):
        load_config(text="RULE=BSP\nMODELFILE=m\nMODELCLASS=M\nDEVICES=cpu\n[comm]\nbackend = tcp\n")


def test_nccl_on_cpu_is_a_config_error() -> None:
    """NCCL with a CPU device is refused up front."""
    with pytest.raises(ConfigError, match="nccl"):
        make_communicator(CommSection(backend="nccl"), torch.device("cpu"))


@pytest.mark.slow
def test_import_does_not_start_mpi() -> None:
    """``import mpicrossbow.comm`` leaves mpi4py unimported, so plain processes never initialise MPI."""
    code = "import sys, mpicrossbow.comm; assert 'mpi4py' not in sys.modules; print('lazy')"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "lazy" in proc.stdout, proc.stderr
