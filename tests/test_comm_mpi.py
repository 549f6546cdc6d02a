"""The real communicators under a real ``mpiexec``, and the backend factory's checks of its input.

Starting torch in an MPI rank costs seconds, so all MPI checks live in one script
(tests/mpi_scripts/comm_check.py), launched once per world size; rank 0 prints one line per check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpicrossbow.comm import BACKENDS, make_communicator, resolve_backend
from mpicrossbow.config import CommSection, load_config
from mpicrossbow.errors import ConfigError
from tests.conftest import REPO, mpi_env, run_mpi

SCRIPT = Path(__file__).parent / "mpi_scripts" / "comm_check.py"
COMMON = (
    "allreduce async_allreduce broadcast ring tags barrier split split_node zero_copy scalars non_contiguous"
).split()
CPU_CHECKS = [f"{b}.{c}" for b in ("mpi", "gloo") for c in COMMON] + ["mpi.buffers", "mpi.factory"]


def verdicts(stdout: str) -> dict[str, str]:
    """``{check name: "OK" | "SKIP ..." | "FAIL ..."}`` from the script's ``CHECK`` lines."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, verdict = line.split(" ", 2)
            found[name] = verdict
    return found


def run_checks(mpiexec: str, n: int, *args: str) -> dict[str, str]:
    proc = run_mpi(mpiexec, n, [sys.executable, str(SCRIPT), *args], timeout=240)
    found = verdicts(proc.stdout)
    failed = {k: v for k, v in found.items() if v.startswith("FAIL")}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
    assert proc.returncode == 0 and "DONE" in proc.stdout, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_communicators_under_mpiexec(mpiexec: str, n: int) -> None:
    """Every CPU check passes on MPICommunicator and TorchDistCommunicator(gloo) at world size n."""
    found = run_checks(mpiexec, n)
    missing = [c for c in CPU_CHECKS if found.get(c) != "OK"]
    assert not missing, f"checks not reported OK: {missing}"


@pytest.mark.mpi
@pytest.mark.cuda
def test_communicators_on_cuda(mpiexec: str) -> None:
    """CUDA tensors through MPI (staged, and CUDA-aware when supported) and NCCL when GPUs suffice."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    found = run_checks(mpiexec, 2, "--cuda")
    assert all(found.get(f"mpi-staged.{c}") == "OK" for c in COMMON if c != "barrier"), found


def test_backend_names() -> None:
    """The valid names, and what ``auto`` means on each device."""
    assert BACKENDS == ("auto", "mpi", "gloo", "nccl")
    assert resolve_backend("auto", torch.device("cpu")) == "mpi"
    assert resolve_backend("auto", "cuda:1") == "nccl"
    assert resolve_backend("gloo", "cpu") == "gloo"


def test_unknown_backend_is_a_config_error() -> None:
    """An unknown name raises ConfigError listing the valid ones, before touching MPI."""
    with pytest.raises(ConfigError, match="auto, mpi, gloo, nccl"):
        load_config(text="RULE=BSP\nMODELFILE=m\nMODELCLASS=M\nDEVICES=cpu\n[comm]\nbackend = tcp\n")


def test_nccl_on_cpu_is_a_config_error() -> None:
    """NCCL with a CPU device is refused up front."""
    with pytest.raises(ConfigError, match="nccl"):
        make_communicator(CommSection(backend="nccl"), torch.device("cpu"))


def test_import_does_not_start_mpi() -> None:
    """``import mpicrossbow.comm`` leaves mpi4py unimported, so plain processes never initialise MPI."""
    code = "import sys, mpicrossbow.comm; assert 'mpi4py' not in sys.modules; print('lazy')"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "lazy" in proc.stdout, proc.stderr
