"""On a GPU: the fused and streams engines train exactly as the serial one. Anywhere: benchmarks/gpu.sh and
the benchmarks' CUDA options say clearly, on a machine without CUDA, what they cannot do.

The ``cuda``-marked tests are what ``benchmarks/gpu.sh`` runs first (``pytest -m cuda tests``); without a
CUDA device they skip. The others check gpu.sh's control flow through a stand-in interpreter (steps in order,
a failed step noted, the time budget) and the pieces of the CUDA modes that need no GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from itertools import chain, count
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import ddp, exchange, gpu, gpu_train, pool
from conftest import REPO
from models.lenet import LeNet
from models.mnist1d import MNIST1DCNN
from models.resnet import ResNet20
from mpicrossbow.config import OptimSection
from mpicrossbow.data.arrays import ArrayDataset
from mpicrossbow.data.dataset_model import DatasetModel
from mpicrossbow.data.loader import LoaderOptions
from mpicrossbow.pool import FusedPool, SerialPool
from mpicrossbow.pool.fused.replicated_network import ReplicatedNetwork
from mpicrossbow.pool.fused.staging import PinnedStaging
from mpicrossbow.pool.spec import PoolSpec
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


def run_gpu_sh(
    python: Path | str, budget: int | None = None, steps: str | None = None
) -> subprocess.CompletedProcess[str]:
    """bash benchmarks/gpu.sh with PYTHON=python (from another folder: it must find the repository itself),
    GPU_SH_SECONDS=budget and GPU_SH_STEPS=steps where given."""
    env = dict(os.environ, PYTHON=str(python))
    env.pop("GPU_SH_SECONDS", None)
    env.pop("GPU_SH_STEPS", None)
    if budget is not None:
        env["GPU_SH_SECONDS"] = str(budget)
    if steps is not None:
        env["GPU_SH_STEPS"] = steps
    return subprocess.run(
        ["bash", str(GPU_SH)], cwd="/", env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_gpu_sh_without_cuda_skips_the_tests_and_writes_nothing() -> None:
    before = GPU_MD.read_bytes() if GPU_MD.exists() else None
    proc = run_gpu_sh(sys.executable)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " skipped" in proc.stdout and " failed" not in proc.stdout and " error" not in proc.stdout
    assert "gpu.sh: the GPU tables need a CUDA device" in proc.stdout
    assert (GPU_MD.read_bytes() if GPU_MD.exists() else None) == before


def test_gpu_sh_runs_every_step_in_order_and_notes_a_failure(tmp_path: Path) -> None:
    """The default steps run in issue 49's priority order (tests, train, exchange, ..., ResNet-50), the
    steps outside the default list (learners, precision, ddp) not at all, and a failed step gets its note."""
    python, log = fake_python(tmp_path, fail="benchmarks.exchange")
    proc = run_gpu_sh(python)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    calls = log.read_text(encoding="utf-8").splitlines()
    assert calls[0].startswith("-m pytest -q -p no:cacheprovider -m cuda tests")
    assert calls[1] == "-m benchmarks.gpu cuda"
    assert calls[2] == "-m benchmarks.gpu header --tests 4 passed, 1004 deselected in 9.00s --tests-rc 0"
    rest = [c.split()[1] for c in calls[3:]]
    assert rest == [
        "benchmarks.gpu_train", "benchmarks.exchange", "benchmarks.gpu", *["benchmarks.pool"] * 3,
        "benchmarks.tta", "benchmarks.pool",
    ]  # fmt: skip
    train, _, note, graphs20, graphs50, streams, tta, resnet50 = calls[3:]
    assert all("--device cuda" in c and "--out gpu" in c for c in calls[3:] if c != note)
    assert "--engines serial,fused,streams" in train and "--bsp-staged" in train
    assert "launch/digits.cfg,launch/mnist1d.cfg" in train
    assert "--graphs off,on" in graphs20 and "--engines fused" in graphs20 and "resnet20" in graphs20
    assert "--precisions fp32,bf16" in graphs50 and "resnet50" in graphs50
    assert "--engines serial,streams" in streams and "--graphs off,on" in streams
    assert tta.startswith("-m benchmarks.tta --device cuda")
    assert resnet50.endswith("--models resnet50")
    assert note.startswith("-m benchmarks.gpu note --step exchange over CUDA --rc 3 --limit ")
    assert proc.stdout.count("left out (GPU_SH_STEPS=") == 4  # learners, precision twice, ddp


def test_gpu_sh_runs_the_steps_outside_the_default_list_by_name(tmp_path: Path) -> None:
    python, log = fake_python(tmp_path)
    proc = run_gpu_sh(python, steps="learners,precision,ddp")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    calls = log.read_text(encoding="utf-8").splitlines()[2:]
    assert [c.split()[1] for c in calls] == ["benchmarks.pool"] * 3 + ["benchmarks.ddp"]
    learners, bf16_20, bf16_50, _ = calls
    assert "--engines serial,fused,streams --learners 1,2,4,8,16 --batches 16,32" in learners
    assert learners.endswith("--models resnet20")
    assert "--precisions fp32,bf16" in bf16_20 and bf16_20.endswith("--models resnet20")
    assert "--precisions fp32,bf16" in bf16_50 and bf16_50.endswith("--models resnet50")


def test_gpu_sh_past_its_budget_starts_no_step(tmp_path: Path) -> None:
    python, log = fake_python(tmp_path)
    proc = run_gpu_sh(python, budget=10)
    assert proc.returncode == 124, proc.stdout[-3000:] + proc.stderr[-2000:]
    notes = [c for c in log.read_text(encoding="utf-8").splitlines() if " note " in c]
    script = GPU_SH.read_text(encoding="utf-8")
    defaults = re.search(r"STEPS=\$\{GPU_SH_STEPS:-([\w,]+)\}", script).group(1).split(",")  # type: ignore[union-attr]
    default_steps = [key for key in re.findall(r"^step (\w+) ", script, re.M) if key in defaults]
    assert len(notes) == len(default_steps) and all(n.endswith("--rc 124 --limit 0") for n in notes)
    assert "CUDA tests not started: the budget of 10 s is spent" in proc.stdout
    assert "not started, gpu.sh's time budget" in gpu.note_text("pool, ResNet-50", 124, 0)
    assert "stopped after its limit of 180 s" in gpu.note_text("pool, ResNet-50", 124, 180)
    assert "failed with exit status 1" in gpu.note_text("pool, ResNet-50", 1, 180)
    assert "FAILED (pytest exit status 1)" in gpu.header_text("1 failed", 1)
    assert "`pytest -m cuda tests`): left out; not run (GPU_SH_STEPS=train)." in gpu.header_text(
        "not run (GPU_SH_STEPS=train)", 0
    )


def test_gpu_sh_runs_only_the_steps_gpu_sh_steps_names(tmp_path: Path) -> None:
    """A second try on a lent GPU: GPU_SH_STEPS=train,resnet50 runs those two steps and no CUDA tests."""
    python, log = fake_python(tmp_path)
    proc = run_gpu_sh(python, steps="train,resnet50")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    calls = log.read_text(encoding="utf-8").splitlines()
    assert calls[0] == "-m benchmarks.gpu cuda"
    assert calls[1] == "-m benchmarks.gpu header --tests not run (GPU_SH_STEPS=train,resnet50) --tests-rc 0"
    assert [c.split()[1] for c in calls[2:]] == ["benchmarks.gpu_train", "benchmarks.pool"]
    assert calls[3].endswith("--models resnet50")
    assert proc.stdout.count("left out (GPU_SH_STEPS=train,resnet50)") == 9


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


def test_pool_grid_stops_before_a_point_that_would_pass_its_time_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gpu.sh kills a step at its limit, losing every row; the grid stops first and names what it left out."""
    clock = chain([0.0, 1.0, 21.0, 22.0, 42.0, 43.0, 63.0, 64.0], count(100.0))  # made at 0; 20 s a point
    monkeypatch.setattr(pool.time, "monotonic", lambda: next(clock))
    deadline = pool.Deadline(80, margin=10)
    grid = [(1, "resnet50", 16, m) for m in (1, 2, 4, 8)]
    assert list(deadline.points(grid)) == grid[:3]  # at 64 s a fourth (25 s with the 1.25 guard) ends past 70
    assert deadline.left_out == grid[3:]
    assert deadline.note().endswith("near: resnet50 m = 8 batch 16.")
    unlimited = pool.Deadline(0)
    assert list(unlimited.points(grid)) == grid and unlimited.note() == ""
    assert pool.parse_args(["--seconds", "120"]).seconds == 120


def test_learners_per_gpu_table_divides_by_one_serial_learner_and_shows_each_peak() -> None:
    one = pool.Row("R", "cuda", 1, 1, 16, 100.0, 110.0, 100.0, 1.0, 5, 105.0, memory={"serial": 10.0})
    four = pool.Row("R", "cuda", 1, 4, 16, 120.0, 300.0, 320.0, 1.0, 5, 250.0)
    four.memory = {"serial": 40.0, "fused": 52.5, "streams": 41.0, "bound": 30.0}
    lines = pool.learners_table([one, four]).splitlines()
    assert lines[0] == (
        "| model | batch/learner | m | serial ÷ one learner | fused ÷ one learner | streams ÷ one learner "
        "| serial peak MiB | fused peak MiB | streams peak MiB | bound peak MiB |"
    )
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[2] == "| R | 16 | 1 | 1.00 | 1.10 | 1.05 | 10 | – | – | – |"
    assert lines[3] == "| R | 16 | 4 | 1.20 | 3.00 | 2.50 | 40 | 52 | 41 | 30 |"


def test_pool_precisions_option_and_table() -> None:
    assert pool.parse_args([]).precisions == ["fp32"]
    assert pool.parse_args(["--precisions", "fp32,bf16"]).precisions == ["fp32", "bf16"]
    for bad in (["--precisions", "fp32,fp8"], ["--precisions", "bf16,bf16"], ["--precisions", ","]):
        with pytest.raises(SystemExit):
            pool.parse_args(bad)
    assert pool.optim_for("fp32") == pool.optim_for("fp32")  # fp32 passes no precision: the default
    assert pool.optim_for("bf16").precision == "bf16"
    row = pool.PrecisionRow("R", "cuda", 1, 8, 32, "fused", {"fp32": 1000.0, "bf16": 1500.0}, {"fp32": 100.0})
    lines = pool.precision_table([row], ["fp32", "bf16"]).splitlines()
    assert lines[0].endswith(
        "| fp32 samples/s | bf16 samples/s | bf16 ÷ fp32 | fp32 peak MiB | bf16 peak MiB |"
    )
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[2] == "| R | cuda | 1 | 8 | 32 | fused | 1,000 | 1,500 | 1.50 | 100 | – |"


def test_pool_precisions_run_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bf16 autocast runs on the CPU, so ``--precisions fp32,bf16`` measures there too (a tiny grid)."""
    argv = ["pool", "--precisions", "fp32,bf16", "--models", "mlp", "--learners", "2", "--batches", "4",
            "--threads", "1", "--rounds", "1", "--round-seconds", "0.01", "--no-write"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    try:
        assert pool.main() == 0
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| MLP")]
    assert len(rows) == 4  # serial and fused, each printed as measured and again in the table
    assert {row.split(" | ")[5] for row in rows} == {"serial", "fused"}
    assert all(float(row.split(" | ")[8]) > 0 for row in rows)  # bf16 ÷ fp32


def test_gpu_train_plans_a_cpu_reference_for_every_engine_and_tabulates() -> None:
    jobs = gpu_train.plan(["serial", "fused", "streams"], "cuda")
    assert [(j.engine, j.device) for j in jobs] == [
        ("serial", "cuda0"), ("serial", "cpu0"), ("fused", "cuda0"), ("fused", "cpu0"), ("streams", "cuda0")
    ]  # fmt: skip
    names = [j.name for j in gpu_train.plan(["streams"], "cuda")]
    assert names == ["digits-streams-cuda0", "digits-serial-cpu0"]
    names = [j.name for j in gpu_train.plan(["serial", "fused"], "cpu")]
    assert names == ["digits-serial-cpu0", "digits-fused-cpu0"]
    args = gpu_train.parse_args(["--epochs", "3"])
    cmd = gpu_train.command(gpu_train.Job("fused", "cuda0"), args, Path("out"))
    assert cmd[1:5] == ["-m", "mpicrossbow.cli", "-cfg", "launch/digits.cfg"]
    assert {"DEVICES=cuda0", "pool.engine=fused", "pool.learners=4", "session.epochs=3"} <= set(cmd)
    with pytest.raises(SystemExit):
        gpu_train.parse_args(["--device", "cpu"])  # the streams engine needs CUDA
    job, done = gpu_train.Job, gpu_train.Outcome
    outcomes = {
        job("serial", "cuda0"): done(0.975, 2.0),
        job("serial", "cpu0"): done(0.98, 3.0),
        job("fused", "cuda0"): done(error="exit status 1: boom"),
        job("streams", "cuda0"): done(0.97, 2.5),
    }
    lines = gpu_train.table(outcomes, jobs, "cuda", 4).splitlines()
    cfg = "| launch/digits.cfg"
    assert lines[2] == f"{cfg} | serial | 1 | 4 | 97.50 % | 98.00 % | -0.50 | 2.0 | 3.0 |"
    assert lines[3].startswith(
        f"{cfg} | fused | 1 | 4 | failed: exit status 1: boom | not run (the step's time was spent) |"
    )
    assert lines[4] == f"{cfg} | streams | 1 | 4 | 97.00 % | 98.00 % (serial's) | -1.00 | 2.5 | 3.0 |"


def test_gpu_train_plans_both_cfgs_and_bsp_on_two_ranks_sharing_the_gpu() -> None:
    """The default plan: the digits job's runs, then BSP on two ranks sharing the GPU through staged MPI
    (with its two-rank CPU pair), then the MNIST-1D CNN's runs at the same overrides on both devices."""
    args = gpu_train.parse_args(["--bsp-staged"])
    jobs = gpu_train.plan(args.engines, "cuda", args.cfgs, args.bsp_staged)
    staged = [j for j in jobs if j.ranks == 2]
    assert [(j.engine, j.devices) for j in staged] == [("fused", "cuda0,cuda0"), ("fused", "cpu0,cpu1")]
    assert jobs.index(staged[0]) == 5  # after the digits job's five runs, before MNIST-1D's
    assert [j.cfg for j in jobs[7:]] == ["launch/mnist1d.cfg"] * 5
    assert len({j.name for j in jobs}) == len(jobs)  # every run has its own folder
    cmd = gpu_train.command(staged[0], args, Path("out"))
    assert {"DEVICES=cuda0,cuda0", "RULE=BSP", "comm.backend=mpi"} <= set(cmd)
    mnist = gpu_train.command(jobs[-1], args, Path("out"))
    assert {"session.epochs=20", "optim.milestones=12,16"} <= set(mnist)
    assert mnist[4] == "launch/mnist1d.cfg"
    lines = gpu_train.table({staged[0]: gpu_train.Outcome(0.96, 4.0)}, jobs, "cuda", 4).splitlines()
    assert "| fused | 2 (one GPU, staged MPI) | 4 | 96.00 % |" in lines[5]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_gpu_train_on_cuda_without_cuda_is_one_clear_line() -> None:
    with pytest.raises(SystemExit) as stop:
        gpu_train.main(["--no-write"])
    assert str(stop.value) == (
        "benchmarks.gpu_train: --device cuda needs a CUDA device, and torch.cuda.is_available() is False"
    )


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


def test_exchange_cuda_summary_sets_the_staging_against_the_copies_and_the_host_sum() -> None:
    """The goal line: staging ÷ the copy floor, and ÷ the floor plus the host sum that no staging avoids."""
    size = 16 << 20
    assert exchange.cuda_rows([exchange.STAGED, exchange.D2D], [], False)[-3:] == [
        exchange.FLOOR, exchange.HOST_SUM, exchange.D2D
    ]  # fmt: skip
    samples = {exchange.STAGED: [6e-3], exchange.WHOLE: [8e-3], exchange.FLOOR: [1e-3]}
    samples[exchange.HOST_SUM] = [3e-3]
    lines = exchange.cuda_summary({"ranks": 2, "samples": {str(size): samples}})
    assert lines == [
        "- 2 ranks, 16M: staging ÷ floor = pipelined (MPI) 6.00, whole-buffer 8.00 (goal: pipelined ≤ 1.5); "
        "the host sum alone ÷ floor 3.00, pipelined ÷ (floor + host sum) 1.50"
    ]
