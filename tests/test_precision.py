"""Mixed precision (``[optim] precision``, :mod:`mpicrossbow.pool.precision`, :mod:`.loss_scale`): the loss
scale's arithmetic, the agreed fp16 skip in ``train_step`` and in the embedded API, the chain step's scale,
every engine under bf16 and fp16 against the serial engine, and checkpoints that resume bit for bit.

The ranks are threads of the in-process world (:class:`~mpicrossbow.testing.InProcessWorld`): the
same Communicator interface the MPI jobs use, so the agreement is the same allreduce.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import stacked
from models.lenet import LeNet
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import OptimSection
from mpicrossbow.config.fields import build
from mpicrossbow.embed.grad_scaler import GradScaler
from mpicrossbow.embed.own_model import OwnModel
from mpicrossbow.embed.precision_forward import PrecisionForward
from mpicrossbow.embed.step_hooks import StepHooks
from mpicrossbow.errors import ConfigError, UsageError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.fused.fused_pool import FusedPool
from mpicrossbow.pool.fused.replica_loss import cross_entropy_and_grad
from mpicrossbow.pool.loss_scale import INITIAL_SCALE, LossScale, LossScaleUnderflow
from mpicrossbow.pool.precision import Precision
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP, SMA
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.run.step import overflow_anywhere, train_step

CPU = torch.device("cpu")


def pool_of(
    engine: type[LearnerPool], precision: str, learners: int = 2, rank: int = 0, size: int = 1, **optim: Any
) -> LearnerPool:
    """A digits MLP pool (or the MNIST-1D CNN with ``model=``) under ``precision``, seeded alike."""
    model = optim.pop("model", None) or MLP(hidden=32)
    fuse = optim.pop("fuse", "auto")
    torch.manual_seed(0)
    spec = PoolSpec(rank, size, 8, OptimSection(lr=0.05, precision=precision, **optim), CPU, 1, learners)
    return engine(model, dataclasses.replace(spec, fuse=fuse))


# ------------------------------------------------------------------ the loss scale alone
def test_dynamic_scale_halves_on_overflow_and_doubles_after_its_window() -> None:
    scale = LossScale(window=3)
    assert scale.scale == INITIAL_SCALE
    scale.update(True)
    assert scale.scale == INITIAL_SCALE / 2 and scale.skipped == 1
    for _ in range(2):
        scale.update(False)
    assert scale.scale == INITIAL_SCALE / 2
    scale.update(False)
    assert scale.scale == INITIAL_SCALE and scale.clean == 0


def test_fixed_scale_never_moves_but_still_skips() -> None:
    scale = LossScale(fixed=128.0, window=1)
    grads = [torch.tensor([256.0, math.inf])]
    assert not scale.unscale(grads)
    assert scale.scale == 128.0 and scale.skipped == 1
    assert torch.equal(grads[0], torch.zeros(2))  # nothing downstream reads an inf
    grads = [torch.tensor([256.0, -128.0])]
    assert scale.unscale(grads) and scale.scale == 128.0
    assert grads[0].tolist() == [2.0, -1.0]


def test_a_scale_falling_below_one_stops_with_a_message() -> None:
    scale = LossScale()
    scale.scale = 1.0
    with pytest.raises(LossScaleUnderflow, match="precision = bf16"):
        scale.update(True)


def test_overflow_on_one_rank_is_agreed_by_every_rank() -> None:
    """Rank 1's inf makes every rank skip and halve; a clean step then goes on everywhere."""

    def body(comm: Communicator) -> tuple[bool, bool, float]:
        scale = LossScale()
        bad = torch.tensor([1.0, math.inf if comm.rank == 1 else 2.0])
        synchronous = SimpleNamespace(comm=comm, synchronous=True)  # what overflow_anywhere reads of a rule

        def agree(found: bool) -> bool:
            return overflow_anywhere(found, synchronous)  # type: ignore[arg-type]

        first = scale.unscale([bad], agree)
        second = scale.unscale([torch.tensor([4.0])], agree)
        return first, second, scale.scale

    assert InProcessWorld(3).run(body) == [(False, True, INITIAL_SCALE / 2)] * 3


def test_loss_scale_needs_fp16() -> None:
    with pytest.raises(ConfigError, match="needs precision = fp16"):
        build(OptimSection, {"loss_scale": "1024"}, "optim")
    assert build(OptimSection, {"precision": "bf16"}, "optim").precision == "bf16"


# ------------------------------------------------------------------ the pools
def test_the_loss_scale_multiplies_the_seed_of_a_step_by_hand() -> None:
    torch.manual_seed(0)
    output, targets = torch.randn(3, 5, 10), torch.randint(0, 10, (3, 5))
    losses, grad = cross_entropy_and_grad(output, targets)
    scaled_losses, scaled = cross_entropy_and_grad(output, targets, 1024.0)
    assert torch.equal(losses, scaled_losses)  # the loss is reported unscaled
    assert torch.equal(scaled, grad * 1024.0)  # a power of two: exact


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("engine", [SerialPool, FusedPool], ids=["serial", "fused"])
def test_every_engine_computes_its_forward_in_16_bits_and_keeps_fp32_state(
    engine: type[LearnerPool], precision: str
) -> None:
    """The 16-bit forward differs from fp32's, the gradients and every flat state stay float32."""
    grads = {}
    for name in ("fp32", precision):
        pool = pool_of(engine, name)
        pool.start_epoch(0)
        pool.compute(0)
        if pool.precision.loss_scale is not None:
            assert pool.precision.loss_scale.unscale([lr.grads for lr in pool.learners])
        grads[name] = stacked(pool, "grads")
        assert all(lr.params.dtype == lr.grads.dtype == torch.float32 for lr in pool.learners)
    low = grads[precision]
    assert not np.array_equal(low, grads["fp32"])
    # 16-bit round-off (and a ReLU that flips here and there): measured 10 % of the gradient's norm in bf16
    # (8 bits of mantissa), 0.5 % in fp16.
    assert np.linalg.norm(low - grads["fp32"]) < 0.2 * np.linalg.norm(grads["fp32"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_fused_chain_by_hand_equals_the_serial_engine_in_16_bits(precision: str) -> None:
    """The MLP's fused step by hand (autocast dtype, loss scale in its seed) against the serial replicas'
    autograd steps in the same precision: the same gradients to 16-bit round-off."""
    serial, fused = pool_of(SerialPool, precision, 4), pool_of(FusedPool, precision, 4, fuse="always")
    assert fused._chain_step is not None  # the step by hand runs
    for pool in (serial, fused):
        pool.start_epoch(0)
        for count in range(3):
            pool.compute(count)
            assert train_step_unscale(pool)
            pool.apply()
    np.testing.assert_allclose(stacked(fused), stacked(serial), rtol=0, atol=2e-3)


def train_step_unscale(pool: LearnerPool) -> bool:
    """What train_step does between backward and the rule for one rank alone."""
    scale = pool.precision.loss_scale
    return scale is None or scale.unscale([lr.grads for lr in pool.learners])


def test_a_fused_cnn_trains_under_bf16_autocast() -> None:
    """LeNet on the digits (grouped convolutions, pooling, a chain head) under the fused engine: finite
    16-bit steps that move the weights."""
    pool = pool_of(FusedPool, "bf16", 2, model=LeNet(), fuse="always")
    before = stacked(pool)
    pool.start_epoch(0)
    for count in range(3):
        pool.compute(count)
        pool.apply()
    after = stacked(pool)
    assert np.isfinite(after).all() and not np.array_equal(before, after)
    assert pool.nonfinite() == []


def test_bsp_keeps_one_allreduce_while_gradients_are_scaled() -> None:
    """fp16: no bucket reads a scaled gradient during backward; bf16 keeps the buckets."""
    assert pool_of(SerialPool, "fp16").grad_layout() is None
    assert pool_of(FusedPool, "fp16").grad_layout() is None
    assert pool_of(SerialPool, "bf16").grad_layout() is not None


def test_fp16_overflow_on_one_rank_skips_that_step_on_every_rank() -> None:
    """BSP and SMA on 2 ranks under fp16: an inf injected into rank 1's gradient at step 2 makes both ranks
    skip step 2 (weights unchanged there), halve their scale alike, and stay in step (BSP: equal replicas)."""

    def body(comm: Communicator, make_rule: Any) -> tuple[list[bool], float, np.ndarray]:
        pool = pool_of(SerialPool, "fp16", 2, comm.rank, comm.size)
        rule = make_rule().bind(comm, pool)
        pool.start_epoch(0)
        moved = []
        for step in range(5):
            before = stacked(pool)

            def inject(at: int) -> None:
                if at == 2 and comm.rank == 1:
                    pool.learners[0].grads[0] = math.inf

            train_step(pool, rule, step, guard=inject)
            moved.append(not np.array_equal(before, stacked(pool)))
        rule.finish()
        assert pool.precision.loss_scale is not None
        return moved, pool.precision.loss_scale.scale, stacked(pool)

    for make_rule in (BSP, SMA):
        results = InProcessWorld(2).run(lambda comm, make=make_rule: body(comm, make))
        for moved, scale, _ in results:
            assert moved == [True, True, False, True, True]
            assert scale == INITIAL_SCALE / 2
        if make_rule is BSP:
            np.testing.assert_array_equal(results[0][2], results[1][2])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("engine", [SerialPool, FusedPool], ids=["serial", "fused"])
def test_a_checkpoint_resumes_bit_for_bit(engine: type[LearnerPool], precision: str) -> None:
    """Six steps straight equal three, a state_dict round trip into a fresh pool, then three more: the
    weights, the optimizer and (fp16) the loss scale."""

    def run(steps: range, pool: LearnerPool) -> None:
        for count in steps:
            pool.compute(count)
            if train_step_unscale(pool):
                pool.apply()

    straight = pool_of(engine, precision, fuse="always")
    straight.start_epoch(0)
    run(range(6), straight)
    first = pool_of(engine, precision, fuse="always")
    first.start_epoch(0)
    run(range(3), first)
    if first.precision.loss_scale is not None:
        first.precision.loss_scale.update(True)  # a scale that moved must come back as it was
        straight.precision.loss_scale.update(True)  # type: ignore[union-attr]
    state = first.state_dict()
    resumed = pool_of(engine, precision, fuse="always")
    resumed.load_state_dict(state)
    resumed.start_epoch(0)
    resumed.skip(3)
    if straight.precision.loss_scale is not None:
        straight_scale = straight.precision.loss_scale.scale
        assert resumed.precision.loss_scale.scale == first.precision.loss_scale.scale  # type: ignore[union-attr]
        assert straight_scale == resumed.precision.loss_scale.scale  # type: ignore[union-attr]
    run(range(3, 6), resumed)
    first_rows = stacked(straight)
    np.testing.assert_array_equal(stacked(resumed), first_rows)


# ------------------------------------------------------------------ the embedded API
def test_precision_forward_returns_float32_and_gives_the_forward_back() -> None:
    net = nn.Sequential(nn.Linear(4, 3))
    wrapped = PrecisionForward(net, Precision("bf16"))
    out = net(torch.randn(2, 4))
    assert out.dtype == torch.float32 and out.requires_grad
    with torch.no_grad():
        exact = net[0](torch.ones(1, 4))
    assert not torch.equal(net(torch.ones(1, 4)).detach(), exact)  # computed in bf16
    wrapped.remove()
    assert "forward" not in net.__dict__ and torch.equal(net(torch.ones(1, 4)).detach(), exact)


def _embedded_body(comm: Communicator, use_scaler: bool) -> tuple[int, float, np.ndarray]:
    """Two ranks of a user's own fp16 loop under BSP; rank 1's gradient overflows at its third step."""
    torch.manual_seed(comm.rank)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    own = OwnModel(net, optimizer, lambda: None, scaled_gradients=True)
    rule = BSP().bind(comm, own)
    hooks = StepHooks(own, rule, precision="fp16")
    forward = PrecisionForward(net, Precision("fp16"))
    scaler = GradScaler("cpu")
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    try:
        for step in range(5):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[comm.rank :: 2]), y[comm.rank :: 2])
            if not use_scaler:
                loss.backward()
                optimizer.step()
                continue
            scaler.scale(loss).backward()
            if step == 2 and comm.rank == 1:
                next(net.parameters()).grad[0, 0] = math.inf
            scaler.step(optimizer)
            scaler.update()
    finally:
        forward.remove()
        hooks.remove()
        rule.finish()
    return hooks.step, float(scaler.get_scale()), own.learner.params.detach().numpy().copy()


def test_the_embedded_grad_scaler_skips_an_overflow_on_every_rank() -> None:
    """torch's GradScaler alone would step rank 0 and skip rank 1 (BSP would wait forever); ours agrees."""
    results = InProcessWorld(2, timeout_s=20).run(lambda comm: _embedded_body(comm, True))
    (steps0, scale0, params0), (steps1, scale1, params1) = results
    assert steps0 == steps1 == 4  # one of five steps skipped, on both ranks
    assert scale0 == scale1 == 2.0**15
    np.testing.assert_array_equal(params0, params1)


def test_fp16_without_the_grad_scaler_is_named() -> None:
    with pytest.raises(UsageError, match=r"xb\.GradScaler"):
        InProcessWorld(1).run(lambda comm: _embedded_body(comm, False))


# ------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("engine", ["serial", "fused", "streams"])
def test_every_engine_trains_in_16_bits_on_cuda(engine: str, precision: str) -> None:
    """Every engine on the GPU under autocast: finite steps that move the fp32 weights, the loss scale
    applied and divided out (fp16), and the same gradients as the serial engine to 16-bit round-off."""
    from mpicrossbow.pool.engines import ENGINES

    cuda = torch.device("cuda", 0)
    pools = []
    for name in ("serial", engine):
        torch.manual_seed(0)
        spec = PoolSpec(0, 1, 8, OptimSection(lr=0.05, precision=precision), cuda, 1, 4)
        pools.append(ENGINES.get(name)(MLP(hidden=32), spec))
    for pool in pools:
        before = stacked(pool)
        pool.start_epoch(0)
        for count in range(3):
            pool.compute(count)
            assert train_step_unscale(pool)
            pool.apply()
        torch.cuda.synchronize()
        assert pool.learners[0].params.dtype == torch.float32
        assert np.isfinite(stacked(pool)).all() and not np.array_equal(before, stacked(pool))
    np.testing.assert_allclose(stacked(pools[1]), stacked(pools[0]), rtol=0, atol=5e-3)
