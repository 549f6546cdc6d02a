"""On a GPU: the fused and streams engines train exactly as the serial one. Anywhere: benchmarks/gpu.sh and
the benchmarks' CUDA options say clearly, on a machine without CUDA, what they cannot do.

The ``cuda``-marked tests are what ``benchmarks/gpu.sh`` runs first (``pytest -m cuda tests``); without a
CUDA device they skip. The others check gpu.sh's control flow through a stand-in interpreter (steps in order,
a failed step noted, the time budget) and the pieces of the CUDA modes that need no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import ddp, exchange, gpu, pool
from conftest import REPO
from models.lenet import LeNet
from models.mnist1d import MNIST1DCNN
from models.resnet import ResNet20
from mpicrossbow.config import OptimSection
from mpicrossbow.data.arrays import ArrayDataset
from mpicrossbow.data.dataset_model import DatasetModel
from mpicrossbow.data.loader import LoaderOptions
from mpicrossbow.pool import FusedPool, SerialPool
from mpicrossbow.pool.replicated_network import ReplicatedNetwork
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.pool.staging import PinnedStaging
from mpicrossbow.pool.streams import StreamsPool

GPU_SH = REPO / "benchmarks" / "gpu.sh"
GPU_MD = REPO / "benchmarks" / "results" / "gpu.md"
OPTIM = OptimSection(lr=0.01, momentum=0.9, weight_decay=1e-4)
STEPS = 3


@pytest.fixture
def exact_cuda() -> Iterator[None]:
    """float32 convolutions and matmuls (no TF32) and deterministic cuDNN algorithms, put back afterwards:
    the engines are compared to float32 round-off, which TF32's 10-bit mantissa would swamp."""
    saved = (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    ) = saved


def mnist1d_cnn() -> DatasetModel:
    """The MNIST-1D CNN, a plain nn.Module (Conv1d: the fused engine's vmap path), on random signals."""
    gen = torch.Generator().manual_seed(1)
    sets = [
        ArrayDataset(torch.randn(n, 40, generator=gen), torch.randint(0, 10, (n,), generator=gen), "random")
        for n in (96, 32)
    ]
    return DatasetModel(MNIST1DCNN, {}, *sets, LoaderOptions())


def train_side_by_side(model: Any, engine: type[SerialPool], m: int = 3, batch: int = 8) -> tuple[Any, Any]:
    """A serial pool and an ``engine`` pool on cuda:0 from the same torch seed, STEPS steps each on the same
    batches; both pools, CUDA synchronised."""
    device = torch.device("cuda", 0)
    made = []
    for cls in (SerialPool, engine):
        torch.manual_seed(0)
        # fuse = always: the fused network itself is what is compared (auto might keep the unfused form).
        made.append(cls(model, PoolSpec(0, 1, batch, OPTIM, device, seed=3, learners=m, fuse="always")))
    for pool_ in made:
        pool_.start_epoch(0)
        for step in range(STEPS):
            pool_.compute(step)
            pool_.apply()
    torch.cuda.synchronize()
    return made[0], made[1]


def assert_learners_close(serial: Any, other: Any, rtol: float, atol: float) -> None:
    """Every learner's flat parameters and buffers equal in both pools, to the tolerance."""
    for a, b in zip(serial.learners, other.learners, strict=True):
        torch.testing.assert_close(b.params, a.params, rtol=rtol, atol=atol)
        torch.testing.assert_close(b.buffers, a.buffers, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "make", [LeNet, mnist1d_cnn], ids=["lenet-layer-by-layer", "mnist1d-cnn-replicated-forward"]
)
@pytest.mark.usefixtures("exact_cuda")
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_equals_serial_on_cuda(make: Any) -> None:
    serial, fused = train_side_by_side(make(), FusedPool)
    assert isinstance(fused.fused, ReplicatedNetwork) == (make is mnist1d_cnn)  # the path each model takes
    assert fused._staging is not None  # batches reached the GPU through pinned buffers
    assert_learners_close(serial, fused, rtol=1e-4, atol=1e-5)
    assert serial.take_stats()[1] == fused.take_stats()[1]  # the same hits


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_staging_never_overwrites_a_batch_in_flight() -> None:
    """Ten stacked batches through the two alternating pinned buffers arrive intact and in order."""
    staging = PinnedStaging(torch.device("cuda", 0))
    sent = [[torch.full((4, 3), float(10 * step + j)) for j in range(2)] for step in range(10)]
    arrived = [staging.stacked("inputs", batch) for batch in sent]
    torch.cuda.synchronize()
    for batch, got in zip(sent, arrived, strict=True):
        assert got.is_cuda and torch.equal(got.cpu(), torch.stack(batch))


@pytest.mark.usefixtures("exact_cuda")
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streams_equal_serial_for_resnet20_on_cuda() -> None:
    serial, streams = train_side_by_side(ResNet20(dataset="digits"), StreamsPool)
    assert_learners_close(serial, streams, rtol=1e-5, atol=1e-6)  # the same kernels, on other streams


def fake_python(tmp_path: Path, fail: str = "") -> tuple[Path, Path]:
    """A stand-in for $PYTHON that logs its arguments and answers as a GPU machine would: CUDA present,
    the CUDA tests passed, every benchmark exits 0 except one whose arguments contain ``fail`` (exit 3).
    Nothing real runs and nothing is written under benchmarks/results. (stand-in, log file)."""
    log = tmp_path / "calls.log"
    script = tmp_path / "python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{log}"\n'
        'case "$*" in\n'
        '  "-m benchmarks.gpu cuda") echo 1 ;;\n'
        '  "-m pytest"*) echo "4 passed, 1004 deselected in 9.00s" ;;\n'
        + (f'  *"{fail}"*) exit 3 ;;\n' if fail else "")
        + "esac\n",
        encoding="utf-8",
    )
    script.chmod(0o755)
    return script, log


def run_gpu_sh(python: Path | str, budget: int | None = None) -> subprocess.CompletedProcess[str]:
    """bash benchmarks/gpu.sh with PYTHON=python (from another folder: it must find the repository itself)."""
    env = dict(os.environ, PYTHON=str(python))
    env.pop("GPU_SH_SECONDS", None)
    if budget is not None:
        env["GPU_SH_SECONDS"] = str(budget)
    return subprocess.run(
        ["bash", str(GPU_SH)], cwd="/", env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_gpu_sh_without_cuda_skips_the_tests_and_writes_nothing() -> None:
    before = GPU_MD.read_bytes() if GPU_MD.exists() else None
    proc = run_gpu_sh(sys.executable)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " skipped" in proc.stdout and " failed" not in proc.stdout and " error" not in proc.stdout
    assert "gpu.sh: the GPU tables need a CUDA device" in proc.stdout
    assert (GPU_MD.read_bytes() if GPU_MD.exists() else None) == before


def test_gpu_sh_runs_every_step_in_order_and_notes_a_failure(tmp_path: Path) -> None:
    python, log = fake_python(tmp_path, fail="benchmarks.ddp")
    proc = run_gpu_sh(python)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    calls = log.read_text(encoding="utf-8").splitlines()
    assert calls[0].startswith("-m pytest -q -p no:cacheprovider -m cuda tests")
    assert calls[1] == "-m benchmarks.gpu cuda"
    assert calls[2] == "-m benchmarks.gpu header --tests 4 passed, 1004 deselected in 9.00s --tests-rc 0"
    rest = [c.split()[1] for c in calls[3:]]
    assert rest == ["benchmarks.pool"] * 2 + ["benchmarks.ddp", "benchmarks.gpu", "benchmarks.exchange"]
    assert "--models resnet20" in calls[3] and "--models resnet50" in calls[4]
    assert all("--device cuda" in c and "--out gpu" in c for c in calls[3:6] + calls[7:])
    assert "--engines serial,fused,streams --learners 1,2,4,8,16 --batches 16,32" in calls[3]
    assert calls[6].startswith("-m benchmarks.gpu note --step BSP vs DDP-NCCL --rc 3 --limit ")


def test_gpu_sh_past_its_budget_starts_no_step(tmp_path: Path) -> None:
    python, log = fake_python(tmp_path)
    proc = run_gpu_sh(python, budget=10)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    notes = [c for c in log.read_text(encoding="utf-8").splitlines() if " note " in c]
    assert len(notes) == 4 and all(n.endswith("--rc 124 --limit 0") for n in notes)
    assert "not started, gpu.sh's time budget" in gpu.note_text("pool, ResNet-50", 124, 0)
    assert "stopped after its limit of 180 s" in gpu.note_text("pool, ResNet-50", 124, 180)
    assert "failed with exit status 1" in gpu.note_text("pool, ResNet-50", 1, 180)
    assert "FAILED (pytest exit status 1)" in gpu.header_text("1 failed", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_pool_on_cuda_without_cuda_is_one_clear_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.pool", "--device", "cuda", "--no-write"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "benchmarks.pool: --device cuda needs a CUDA device, and torch.cuda.is_available() is False"
    ]


def test_pool_engine_options() -> None:
    assert pool.parse_args([]).engines == ["serial", "fused"] and pool.parse_args([]).device == "cpu"
    args = pool.parse_args(["--device", "cuda", "--engines", "serial,fused,streams", "--out", "gpu"])
    assert args.engines == ["serial", "fused", "streams"] and args.out == "gpu"
    for bad in (["--engines", "serial,fused,streams"], ["--engines", "serial"], ["--engines", "fused,warp"]):
        with pytest.raises(SystemExit):
            pool.parse_args(bad)
    row = pool.Row("m", "cuda", 1, 4, 16, 100.0, 300.0, 400.0, 1.0, 5, streams=150.0)
    one = pool.Row("m", "cuda", 1, 1, 16, 100.0, 90.0, 100.0, 1.0, 5, streams=None)
    lines = pool.table([one, row]).splitlines()
    assert lines[0].endswith("| streams samples/s | streams ÷ serial |")
    assert lines[2].endswith("| – | – |") and lines[3].endswith("| 150 | 1.50 |")
    assert "streams" not in pool.table([pool.Row("m", "cpu", 1, 1, 4, 1.0, 1.0, 1.0, 1.0, 1)])


def test_ddp_on_cuda_needs_a_gpu_per_rank() -> None:
    assert ddp.gpu_shortfall("cpu", 2, 0) is None
    assert ddp.gpu_shortfall("cuda", 2, 2) is None
    assert ddp.gpu_shortfall("cuda", 2, 1) == (
        "needs ≥ 2 GPUs (NCCL: one GPU per rank), this machine has 1: skipped"
    )
    assert "no CUDA device" in str(ddp.gpu_shortfall("cuda", 2, 0))
    assert "needs ≥ 2 GPUs" in str(ddp.gpu_shortfall("cuda", 1, 1))  # BSP vs DDP means 2 ranks at least


def test_exchange_on_cuda_plans_what_one_gpu_allows() -> None:
    names, skipped = exchange.cuda_plan(2, 1, False, "MPICH")
    assert names == [exchange.STAGED, exchange.D2D]
    assert (
        "NCCL refuses two ranks on one GPU" in skipped[exchange.NCCL] and "MPICH" in skipped[exchange.AWARE]
    )
    names, skipped = exchange.cuda_plan(2, 2, True, "Open MPI")
    assert names == [exchange.STAGED, exchange.AWARE, exchange.NCCL, exchange.D2D] and not skipped
    result = {
        "ranks": 2,
        "sizes": [1024],
        "rounds": {"1024": 3},
        "samples": {"1024": {exchange.STAGED: [2e-5], exchange.D2D: [1e-5]}},
        "reference": exchange.STAGED,
        "copy": exchange.D2D,
        "skipped": {exchange.NCCL: "needs one GPU per rank"},
    }
    text = exchange.table(result)
    assert "| ÷ device copy | ÷ staged MPI |" in text and "| 2.00 | 1.000 |" in text
    assert text.endswith(f"- {exchange.NCCL}: skipped, needs one GPU per rank")
    assert exchange.summary([result]) == ""
