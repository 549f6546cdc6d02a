"""A lent GPU machine's one command line and its carry, checked on a CPU.

benchmarks/gpu.py defines the command line (``DEVICE_COMMAND``) and the carry list (``CARRY``) once; the
README quotes both. benchmarks/gpu_carry.sh fills the carry and refuses one of 64 MiB or more;
benchmarks/gpu_device.sh, what the command line runs, is exercised here without CUDA, without network (pip
is pointed at an address nothing listens on) and with stand-in carries: it writes its logs and summary
whether its set-up works or fails, and removes its temporary virtual environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu
from conftest import REPO

CARRY_SH = REPO / "benchmarks" / "gpu_carry.sh"
DEVICE_SH = REPO / "benchmarks" / "gpu_device.sh"
README = REPO / "benchmarks" / "README.md"
GPU_MD = REPO / "benchmarks" / "results" / "gpu.md"
#: pip's index, should anything ask it: an address where nothing listens, so a request fails at once.
NO_NETWORK = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_TIMEOUT": "2"}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


def test_the_command_line_fits_and_the_readme_quotes_it_and_the_carry() -> None:
    assert len(gpu.DEVICE_COMMAND) < gpu.COMMAND_LIMIT
    assert gpu.DEVICE_COMMAND.startswith("bash benchmarks/gpu_device.sh ")
    readme = README.read_text(encoding="utf-8")
    assert f"```bash\n   {gpu.DEVICE_COMMAND}\n   ```" in readme  # a code block of its own
    assert json.dumps(list(gpu.CARRY)) in readme
    assert all(f"/{path}/" in (REPO / ".gitignore").read_text(encoding="utf-8") for path in gpu.CARRY)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "device-command"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.splitlines() == [gpu.DEVICE_COMMAND, json.dumps(list(gpu.CARRY))]


def test_readme_quotes_gpu_device_sh_default_budget() -> None:
    script = DEVICE_SH.read_text(encoding="utf-8")
    assert "BUDGET=${GPU_DEVICE_SECONDS:-420}" in script
    assert "`GPU_DEVICE_SECONDS` (default 420 s" in README.read_text(encoding="utf-8")


def check_carry(folder: Path) -> subprocess.CompletedProcess[str]:
    """``benchmarks/gpu_carry.sh --check`` on ``folder``: its size against the limit, nothing downloaded."""
    env = dict(os.environ, GPU_CARRY_DIR=str(folder), **NO_NETWORK)
    return subprocess.run(
        ["bash", str(CARRY_SH), "--check"], cwd="/", env=env, capture_output=True, text=True, timeout=60
    )


def test_gpu_carry_sh_refuses_a_carry_of_64_mib(tmp_path: Path) -> None:
    folder = tmp_path / "carry"
    folder.mkdir()
    wheel = folder / "big-1.0-py3-none-any.whl"
    with wheel.open("wb") as f:  # sparse: the apparent size is what counts, nothing is written
        f.truncate(gpu.CARRY_LIMIT_BYTES - 2**16)
    proc = check_carry(folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "of the 64 MiB carry limit" in proc.stdout
    with wheel.open("wb") as f:
        f.truncate(gpu.CARRY_LIMIT_BYTES)
    proc = check_carry(folder)
    assert proc.returncode == 1 and "too large to carry" in proc.stderr, proc.stdout + proc.stderr
    assert check_carry(tmp_path / "missing").returncode == 1


@pytest.mark.skipif(not (REPO / gpu.CARRY[0]).is_dir(), reason="no carry here (benchmarks/gpu_carry.sh)")
def test_the_prepared_carry_is_under_the_limit() -> None:
    size = sum(p.stat().st_size for path in gpu.CARRY for p in (REPO / path).rglob("*") if p.is_file())
    assert 0 < size < gpu.CARRY_LIMIT_BYTES
    assert check_carry(REPO / gpu.CARRY[0]).returncode == 0


def tiny_wheel(folder: Path, name: str = "fakecarry") -> Path:
    """A valid pure-Python wheel of one empty module, built by hand (what pip installs offline)."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(f, text)
    return path


def run_device_sh(tmp_path: Path, carry: Path, **extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``bash benchmarks/gpu_device.sh OUT`` with this interpreter as the machine's Python and ``carry`` as
    the carry, the temporary folder under tmp_path; (the process, OUT)."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, GPU_CARRY_DIR=str(carry), TMPDIR=str(tmp), **NO_NETWORK)
    for key in ("GPU_DEVICE_SECONDS", "GPU_DEVICE_INSTALL", "GPU_SH_SECONDS", "GPU_SH_STEPS"):
        env.pop(key, None)
    env.update(extra)
    before = GPU_MD.read_bytes() if GPU_MD.exists() else None
    proc = subprocess.run(
        ["bash", str(DEVICE_SH), str(out)], cwd="/", env=env, capture_output=True, text=True, timeout=180
    )
    assert (GPU_MD.read_bytes() if GPU_MD.exists() else None) == before
    assert not any(tmp.iterdir()), "the temporary virtual environment was left behind"
    return proc, out


@pytest.mark.slow
@no_cuda
def test_gpu_device_sh_installs_offline_and_writes_its_logs(tmp_path: Path) -> None:
    carry = tmp_path / "carry"
    carry.mkdir()
    tiny_wheel(carry)
    (carry / "tqdm-0.0.1-py3-none-any.whl").write_text("not a wheel")  # tqdm imports: left out, not tried
    # GPU_SH_STEPS leaves out the CUDA tests (their CPU path has its own test): gpu.sh only finds no CUDA.
    proc, out = run_device_sh(tmp_path, carry, GPU_SH_STEPS="learners")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    names = {p.name for p in out.iterdir()}
    assert {"device.log", "setup.log", "pip.log", "versions.txt", "nvidia-smi.txt", "gpu_sh.log"} <= names
    assert "summary.txt" in names and "gpu.md" not in names  # without CUDA gpu.sh appends nothing
    log = (out / "device.log").read_text(encoding="utf-8")
    assert "-m pip install --no-index --no-deps --ignore-installed --no-cache-dir fakecarry-1.0" in log
    assert "tqdm: the machine's Python imports tqdm; its carried wheel is left out" in log
    assert "the project imports from any folder" in log and "FAILED" not in log
    assert f"no MNIST-1D cache in {carry}/mnist1d: the MNIST-1D runs need the mnist1d package" in log
    assert "Successfully installed fakecarry-1.0" in (out / "pip.log").read_text(encoding="utf-8")
    versions = (out / "versions.txt").read_text(encoding="utf-8")
    assert f"torch: {torch.__version__} from " in versions and "cuda: no CUDA device" in versions
    assert "gpu.sh: the GPU tables need a CUDA device" in (out / "gpu_sh.log").read_text(encoding="utf-8")
    summary = (out / "summary.txt").read_text(encoding="utf-8").splitlines()
    assert (
        summary[:1] == ["exit status: 0"] and "set-up: ok" in summary and "gpu.sh exit status: 0" in summary
    )


@pytest.mark.slow
@no_cuda
def test_gpu_device_sh_goes_on_when_a_step_fails_and_keeps_to_its_budget(tmp_path: Path) -> None:
    carry = tmp_path / "carry"
    carry.mkdir()
    (carry / "broken-1.0-py3-none-any.whl").write_text("not a wheel")
    # 30 s leaves less than gpu.sh's 30 s minimum once 20 s are kept for copying back: it is not started.
    proc, out = run_device_sh(tmp_path, carry, GPU_DEVICE_SECONDS="30")
    assert proc.returncode == 124, proc.stdout[-3000:] + proc.stderr[-2000:]
    log = (out / "device.log").read_text(encoding="utf-8")
    assert "FAILED: pip install of the carried wheels" in log and "gpu.sh not started" in log
    assert "the project imports from any folder" in log  # the steps after the failed one still ran
    assert (out / "versions.txt").exists() and (out / "pip.log").exists()
    summary = (out / "summary.txt").read_text(encoding="utf-8")
    assert "set-up: FAILED" in summary and "gpu.sh exit status: 124" in summary
