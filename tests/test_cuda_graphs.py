"""CUDA graphs for the pools' steps (``[pool] cuda_graphs``): the setting, when a graph replays, warms up or
is captured, what refuses it; on a CPU nothing changes; on a GPU a captured step trains as the eager one
(serial, fused and streams engines), through a checkpoint round trip and a resize."""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from conftest import NormedMLP, stacked
from models.lenet import LeNet
from mpicrossbow.config import OptimSection, load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import FusedPool, SerialPool
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.cuda_graphs import (
    LEARNER_STEP,
    OPTIMIZER_STEP,
    WARMUP,
    CapturePlan,
    GraphSwitch,
    graphs_enabled,
    optimizer_refusal,
    optimizer_settings,
)
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.pool.streams import StreamsPool

OPTIM = OptimSection(lr=0.05, momentum=0.9, weight_decay=5e-4)
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def spec(device: torch.device, graphs: str, learners: int = 4, batch: int = 16, **kw: Any) -> PoolSpec:
    """A pool spec on ``device`` with ``[pool] cuda_graphs = graphs``."""
    return PoolSpec(0, 1, batch, OPTIM, device, seed=3, learners=learners, cuda_graphs=graphs, **kw)  # type: ignore[arg-type]


def train(pool: LearnerPool, steps: int, start: int = 0) -> None:
    """``steps`` training steps from batch ``start`` of the current epoch."""
    for count in range(start, start + steps):
        pool.compute(count)
        pool.apply()


# ---------------------------------------------------------------- the setting


def test_cuda_graphs_is_a_pool_key_defaulting_to_auto_and_names_itself_when_wrong() -> None:
    base = "RULE=BSP\nMODELFILE=models.mlp\nMODELCLASS=MLP\nDEVICES=cpu0\n"
    assert load_config(text=base).pool.cuda_graphs == "auto"
    assert load_config(text=base + "[pool]\ncuda_graphs = on\n").pool.cuda_graphs == "on"
    assert load_config(text=base, overrides=["pool.cuda_graphs=off"]).pool.cuda_graphs == "off"
    with pytest.raises(ConfigError, match=r"\[pool\] cuda_graphs") as info:
        load_config(text=base + "[pool]\ncuda_graphs = maybe\n")
    assert "\n" not in str(info.value)
    assert PoolSpec().cuda_graphs == "auto" and spec(CPU, "off").resized(2).cuda_graphs == "off"


def test_auto_is_off_on_the_cpu_and_on_is_one_line_naming_the_key() -> None:
    assert not graphs_enabled("auto", CPU) and not graphs_enabled("off", CUDA)
    assert graphs_enabled("auto", CUDA) and graphs_enabled("on", CUDA)  # no CUDA call: the device's type
    for engine in (SerialPool, FusedPool):
        with pytest.raises(
            ConfigError, match=r"^\[pool\] cuda_graphs = on needs a CUDA device, this rank has cpu"
        ):
            engine(LeNet(), spec(CPU, "on", learners=2))
    with pytest.raises(ConfigError, match=r"cuda_graphs = 'sometimes'"):
        graphs_enabled("sometimes", CUDA)


def test_a_theano_form_model_refuses_cuda_graphs_on() -> None:
    from conftest import REPO
    from mpicrossbow.launch.world import World
    from mpicrossbow.rules.registry import build_rule
    from mpicrossbow.training.run.pool_builder import build_pool

    golden = REPO / "tests" / "data" / "theano_mpi" / "session_single_node.cfg"
    config = load_config(golden, ["pool.cuda_graphs=on"])
    world = World(0, 2, 0, 2, 0, 1, "localhost", None)
    with pytest.raises(ConfigError, match=r"cuda_graphs = on: .*Theano-MPI-form model"):
        build_pool(config, world, build_rule("BSP", {"mode": "avg"}), CPU, 1)


# ---------------------------------------------------------------- when a graph is captured


def test_a_new_key_warms_up_then_is_captured_and_replays() -> None:
    plan = CapturePlan()
    assert [plan.next("a") for _ in range(WARMUP)] == ["eager"] * (WARMUP - 1) + ["probe"]
    assert plan.next("a") == "capture"
    plan.done("a")
    assert [plan.next("a") for _ in range(3)] == ["replay"] * 3


def test_a_passing_key_runs_eagerly_and_keeps_the_graph_a_lasting_one_replaces_it() -> None:
    plan = CapturePlan(warmup=2)
    plan.next("a"), plan.next("a"), plan.next("a")
    plan.done("a")
    assert plan.next("partial") == "eager"  # the last, short batch of an epoch
    assert plan.next("a") == "replay"  # the graph is still there
    assert plan.next("partial") == "eager", "an interrupted run of a key starts counting again"
    assert [plan.next("lr 0.01") for _ in range(3)] == ["eager", "probe", "capture"]
    plan.done("lr 0.01")
    assert plan.next("a") == "eager" and plan.next("lr 0.01") == "replay"
    plan.reset()
    assert plan.next("lr 0.01") == "eager"
    with pytest.raises(ValueError, match="warmup"):
        CapturePlan(warmup=0)


def test_the_optimizer_step_is_captured_for_sgd_and_capturable_optimizers_only() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert optimizer_refusal([torch.optim.SGD(params, lr=0.1, momentum=0.9)]) is None
    assert optimizer_refusal([torch.optim.Adam(params, capturable=True)]) is None
    reason = optimizer_refusal([torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params)])
    assert reason is not None and "Adam's parameter groups have capturable=False" in reason
    reason = optimizer_refusal([torch.optim.LBFGS(params)])
    assert reason == "LBFGS is neither torch.optim.SGD nor built with capturable=True"


def test_the_optimizer_key_follows_its_settings_and_a_state_load() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    key = optimizer_settings([optimizer])
    assert optimizer_settings([optimizer]) == key
    optimizer.param_groups[0]["lr"] = 0.05
    assert optimizer_settings([optimizer]) != key
    key = optimizer_settings([optimizer])
    optimizer.load_state_dict(optimizer.state_dict())  # torch makes a new state: the graph's would be stale
    assert optimizer_settings([optimizer]) != key


def test_each_refusal_is_logged_once_and_is_an_error_under_on(caplog: pytest.LogCaptureFixture) -> None:
    switch = GraphSwitch("auto", CUDA)
    with caplog.at_level(logging.INFO, logger="mpicrossbow.pool.cuda_graphs"):
        switch.refuse(LEARNER_STEP, "it synchronizes with the host (model.py:12)")
        switch.refuse(LEARNER_STEP, "it synchronizes with the host (model.py:12)")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "cuda_graphs: the learner step runs eagerly for the rest of this run: it synchronizes with the host "
        "(model.py:12)"
    ]
    assert not switch.allows(LEARNER_STEP) and switch.allows(OPTIMIZER_STEP)
    assert switch.step(LEARNER_STEP, lambda: None) is None
    switch.hold(OPTIMIZER_STEP, "a test holds it")
    assert not switch.allows(OPTIMIZER_STEP)
    switch.release(OPTIMIZER_STEP)
    assert switch.allows(OPTIMIZER_STEP)
    strict = GraphSwitch("on", CUDA)
    with pytest.raises(
        ConfigError, match=r"^\[pool\] cuda_graphs = on: the optimizer step cannot be captured"
    ):
        strict.check_optimizers([torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])])
    assert GraphSwitch("auto", CPU).record() == {}


# ---------------------------------------------------------------- on the CPU, nothing changes


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda s: SerialPool(LeNet(), s), id="serial"),
        pytest.param(lambda s: FusedPool(LeNet(), dataclasses.replace(s, fuse="always")), id="fused"),
        # the form pinned: two runs' timed trials (fuse = auto) may pick different forms on a busy machine
        pytest.param(
            lambda s: FusedPool(NormedMLP(), dataclasses.replace(s, fuse="never")), id="fused-unfused"
        ),
    ],
)
def test_auto_on_the_cpu_trains_exactly_as_off(make: Callable[[PoolSpec], LearnerPool]) -> None:
    pools = []
    for graphs in ("auto", "off"):
        torch.manual_seed(0)
        pool = make(spec(CPU, graphs, learners=3, batch=8))
        pool.start_epoch(0)
        train(pool, 12)
        pools.append(pool)
    auto, off = pools
    np.testing.assert_array_equal(stacked(auto), stacked(off))
    np.testing.assert_array_equal(stacked(auto, "buffers"), stacked(off, "buffers"))
    assert auto.take_stats() == off.take_stats()
    assert not auto.graphs.enabled and "cuda_graphs" not in auto.run_record()  # type: ignore[attr-defined]
    assert auto.grad_layout() == off.grad_layout() is not None  # BSP's buckets as before


# ---------------------------------------------------------------- on a GPU


def _pools(make: Callable[[PoolSpec], LearnerPool], graphs: tuple[str, ...], **kw: Any) -> list[LearnerPool]:
    pools = []
    for setting in graphs:
        torch.manual_seed(0)
        pools.append(make(spec(CUDA, setting, **kw)))
    return pools


def _close(a: LearnerPool, b: LearnerPool, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Every learner's params and buffers equal to round-off (the same kernels, captured or not; cuDNN's
    backward may add in another order from run to run)."""
    torch.cuda.synchronize()
    for x, y in zip(a.learners, b.learners, strict=True):
        torch.testing.assert_close(x.params, y.params, rtol=rtol, atol=atol)
        torch.testing.assert_close(x.buffers, y.buffers, rtol=rtol, atol=atol)


BF16 = dataclasses.replace(OPTIM, precision="bf16")
ENGINES = [
    pytest.param(lambda s: SerialPool(LeNet(), s), id="serial"),
    pytest.param(lambda s: FusedPool(LeNet(), dataclasses.replace(s, fuse="always")), id="fused"),
    pytest.param(
        lambda s: FusedPool(NormedMLP(), dataclasses.replace(s, fuse="replicated")), id="fused-replicated"
    ),
]


@pytest.mark.parametrize(
    "make",
    [
        *ENGINES,
        pytest.param(lambda s: SerialPool(LeNet(), dataclasses.replace(s, optim=BF16)), id="serial-bf16"),
    ],
)
@pytest.mark.cuda
@needs_cuda
def test_a_captured_step_trains_as_the_eager_one(make: Callable[[PoolSpec], LearnerPool]) -> None:
    graphed, eager = _pools(make, ("on", "off"))
    for pool in (graphed, eager):
        pool.start_epoch(0)
        train(pool, WARMUP + 5)
    assert graphed.graphs.captures[LEARNER_STEP] >= 1 and graphed.graphs.captures[OPTIMIZER_STEP] == 1  # type: ignore[attr-defined]
    bf16 = graphed.precision.name == "bf16"
    _close(graphed, eager, *((1e-3, 1e-4) if bf16 else ()))
    assert graphed.take_stats() == pytest.approx(eager.take_stats(), rel=1e-5)
    assert '"setting": "on"' in graphed.run_record()["cuda_graphs"]


@pytest.mark.cuda
@needs_cuda
def test_streams_with_graphs_train_as_the_serial_engine() -> None:
    torch.manual_seed(0)
    serial = SerialPool(LeNet(), spec(CUDA, "off"))
    torch.manual_seed(0)
    streams = StreamsPool(LeNet(), spec(CUDA, "on"))
    for pool in (serial, streams):
        pool.start_epoch(0)
        train(pool, WARMUP + 5)
    assert streams.graphs.captures[LEARNER_STEP] == len(streams.learners)
    _close(streams, serial)


@pytest.mark.parametrize("make", ENGINES[:2])
@pytest.mark.cuda
@needs_cuda
def test_a_checkpoint_round_trip_with_graphs(make: Callable[[PoolSpec], LearnerPool]) -> None:
    first, fresh, eager = _pools(make, ("on", "on", "off"))
    for pool in (first, eager):
        pool.start_epoch(0)
        train(pool, WARMUP + 3)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    train(first, 6, start=WARMUP + 3)
    train(eager, 6, start=WARMUP + 3)
    _close(first, eager)
    captured = first.graphs.captures[LEARNER_STEP]  # type: ignore[attr-defined]
    for pool in (first, fresh):  # the pool whose graphs are live, and a new one
        buffer.seek(0)
        pool.load_state_dict(torch.load(buffer, map_location=CUDA, weights_only=True))
        pool.start_epoch(0)
        pool.skip(WARMUP + 3)
        train(pool, 6, start=WARMUP + 3)
        _close(pool, eager)
    assert first.graphs.captures[LEARNER_STEP] > captured, "a load captures the graphs anew"  # type: ignore[attr-defined]


@pytest.mark.parametrize("make", ENGINES[:2])
@pytest.mark.cuda
@needs_cuda
def test_a_resize_captures_anew(make: Callable[[PoolSpec], LearnerPool]) -> None:
    graphed, eager = _pools(make, ("on", "off"), learners=2)
    for pool in (graphed, eager):
        pool.start_epoch(0)
        train(pool, WARMUP + 3)
    captured = graphed.graphs.captures[LEARNER_STEP]  # type: ignore[attr-defined]
    for pool in (graphed, eager):
        pool.resize(3)
        pool.start_epoch(1)
        train(pool, WARMUP + 3)
    assert graphed.graphs.captures[LEARNER_STEP] > captured  # type: ignore[attr-defined]
    _close(graphed, eager)


@pytest.mark.cuda
@needs_cuda
def test_a_graphed_step_replays_runs_other_shapes_eagerly_and_refuses_a_host_sync() -> None:
    switch = GraphSwitch("auto", CUDA)
    total = torch.zeros((), device=CUDA)

    def add(x: torch.Tensor) -> torch.Tensor:
        total.add_(x.to(CUDA, non_blocking=True).sum())
        return total * 2

    step = switch.step(LEARNER_STEP, add)
    assert step is not None
    for i in range(WARMUP + 3):
        out = step(torch.full((4,), float(i)))
    assert switch.captures[LEARNER_STEP] == 1
    step(torch.ones(3))  # another shape: eagerly, the graph kept
    out = step(torch.full((4,), 10.0))
    assert switch.captures[LEARNER_STEP] == 1
    expected = 4 * sum(range(WARMUP + 3)) + 3 + 40
    assert float(total) == expected and float(out) == 2 * expected

    def syncs(x: torch.Tensor) -> torch.Tensor:
        return torch.full((), float(x.to(CUDA).sum().item()), device=CUDA)

    for setting in ("auto", "on"):
        switch = GraphSwitch(setting, CUDA)
        step = switch.step(LEARNER_STEP, syncs)
        assert step is not None
        if setting == "on":
            with pytest.raises(
                ConfigError, match=r"cuda_graphs = on: the learner step .*synchronizes with the host"
            ):
                for _ in range(WARMUP):
                    step(torch.ones(2))
            continue
        for _ in range(WARMUP + 3):
            assert float(step(torch.ones(2))) == 2.0
        assert "it synchronizes with the host (" in switch.refused[LEARNER_STEP]
        assert switch.captures[LEARNER_STEP] == 0


@pytest.mark.cuda
@needs_cuda
def test_gradient_watchers_keep_the_learner_step_eager_while_they_watch() -> None:
    torch.manual_seed(0)
    pool = SerialPool(LeNet(), spec(CUDA, "auto", learners=2))
    ready: list[tuple[int, int]] = []
    unwatch = pool.watch_gradients(lambda i, n: ready.append((i, n)))
    pool.start_epoch(0)
    train(pool, WARMUP + 2)
    assert pool.graphs.captures[LEARNER_STEP] == 0 and len(ready) == (WARMUP + 2) * 2 * 10
    unwatch()
    train(pool, WARMUP + 2, start=WARMUP + 2)
    assert pool.graphs.captures[LEARNER_STEP] == 2
    assert SerialPool(LeNet(), spec(CUDA, "on", learners=2)).grad_layout() is None


@pytest.mark.parametrize("make", ENGINES[:2])
@pytest.mark.cuda
@needs_cuda
def test_a_captured_step_with_the_nan_guard_never_waits_for_the_device(
    make: Callable[[PoolSpec], LearnerPool],
) -> None:
    """Once captured, a step (the batch's copy, both replays, the NaN guard) queues its work and returns:
    torch's synchronisation check, set to error, finds no operation that waits for the GPU. A step that did
    would stop the host from preparing the next step while the GPU computes (the one-GPU showdown)."""
    from mpicrossbow.config import InjectSection
    from mpicrossbow.training.health.faults import FaultInjector
    from mpicrossbow.training.run.nan_guard import NanGuard

    (pool,) = _pools(make, ("on",))
    guard, faults = NanGuard("skip"), FaultInjector(InjectSection(), 0)
    pool.start_epoch(0)
    for count in range(WARMUP + 2):  # warm-up and capture, outside the check
        pool.compute(count)
        guard.check(pool, faults, count, 0)
        pool.apply()
    torch.cuda.synchronize()
    captured = dict(pool.graphs.captures)  # type: ignore[attr-defined]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for count in range(WARMUP + 2, WARMUP + 6):
            pool.compute(count)
            guard.check(pool, faults, count, 0)
            pool.apply()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    guard.flush()
    assert pool.graphs.captures == captured and captured[LEARNER_STEP] >= 1  # type: ignore[attr-defined]
    assert all(torch.isfinite(learner.params).all() for learner in pool.learners)
