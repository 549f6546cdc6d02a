"""The fused engine against the serial reference: same replicas, same batches, same state after k steps.

Both pools are built under the same torch seed (so their m replicas start equal) and read the same shards;
after every step the fused pool's flat rows must equal the serial learners' flat buffers (parameters,
gradients and BatchNorm running statistics) to float32 round-off. The rules must run on it unchanged. What
every engine promises (flat state, stats, validation, checkpoints, resize) is test_pool_contract.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from user_project.net import DigitsNet

from conftest import run_world
from models.imagenet_resnet import resnet18
from models.lenet import LeNet
from models.mlp import MLP
from models.mnist1d import MNIST1DCNN
from models.resnet import ResNet20
from models.transformer import Tokens, TransformerBlock
from models.vgg import VGG
from mpicrossbow.config import OptimSection
from mpicrossbow.data.arrays import ArrayDataset
from mpicrossbow.data.dataset_model import DatasetModel
from mpicrossbow.data.loader import LoaderOptions
from mpicrossbow.model.contract import sgd_settings
from mpicrossbow.model.shard import Shard
from mpicrossbow.pool import FusedPool, SerialPool
from mpicrossbow.pool.fused.fused_conv1d import FusedConv1d
from mpicrossbow.pool.fused.fused_pool import default_recipe
from mpicrossbow.pool.fused.replicated_network import ReplicatedNetwork
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP, SMA

CPU = torch.device("cpu")
OPTIM = OptimSection(lr=0.01, momentum=0.9, weight_decay=1e-4)
STEPS = 3
ATOL = 1e-5
#: Gradients of a 20-layer BatchNorm net differ by up to ~3e-6 of their largest entry between a grouped and
#: a plain convolution (float32 sums in another order, measured); parameters and buffers by ~5e-7.
GRAD_TOL = 3e-5


def pools(
    model: Any, m: int, batch: int = 8, rank: int = 0, size: int = 1, fuse: str = "always"
) -> tuple[SerialPool, FusedPool]:
    """A serial and a fused pool whose replicas start equal (the fused one in form ``fuse``: by default
    always the fused network, which is what these tests compare)."""
    torch.manual_seed(0)
    serial = SerialPool(model, PoolSpec(rank, size, batch, OPTIM, CPU, seed=3, learners=m))
    torch.manual_seed(0)
    fused = FusedPool(model, PoolSpec(rank, size, batch, OPTIM, CPU, seed=3, learners=m, fuse=fuse))
    return serial, fused


def assert_rows_equal(serial: SerialPool, fused: FusedPool, attr: str, tol: float = ATOL) -> None:
    """Learner j's flat ``attr`` equal in both engines, for every j, to ``tol`` relative to its largest entry.

    Relative, because gradients reach magnitudes of tens where float32 round-off of a differently ordered
    sum (a grouped convolution against a plain one) exceeds a fixed 1e-5.
    """
    for j, (a, b) in enumerate(zip(serial.learners, fused.learners, strict=True)):
        ref, got = getattr(a, attr), getattr(b, attr)
        if not ref.numel():
            continue
        diff, scale = (ref - got).abs().max().item(), max(1.0, ref.abs().max().item())
        assert diff <= tol * scale, f"learner {j}: {attr} differ by {diff} (largest entry {scale})"


def train_alongside(serial: SerialPool, fused: FusedPool, steps: int = STEPS) -> None:
    """``steps`` steps of both pools on the same batches: gradients equal each step, weights and buffers
    after."""
    serial.start_epoch(0)
    fused.start_epoch(0)
    for step in range(steps):
        serial.compute(step)
        fused.compute(step)
        assert_rows_equal(serial, fused, "grads", GRAD_TOL)
        serial.apply()
        fused.apply()
    assert_rows_equal(serial, fused, "params")
    assert_rows_equal(serial, fused, "buffers")


class SmoothedAdamMLP(MLP):
    """An MLP with its own loss and optimizer: the fused engine's per-replica loss and fused-params paths."""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, label_smoothing=0.1)

    def optimizer(self, params: Any, optim: OptimSection) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-3)


class OwnSGDMLP(MLP):
    """An MLP whose optimizer is SGD with its own learning rate: not the default recipe."""

    def optimizer(self, params: Any, optim: OptimSection) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=optim.lr * 2, momentum=optim.momentum)


def test_the_default_recipe_steps_the_rows_any_other_optimizer_the_fused_parameters() -> None:
    """The optimizer is chosen by what it declares (class, groups, settings), not by which method built it."""
    _, default = pools(MLP(hidden=8), 3)
    assert [p.shape for p in default.optimizer.param_groups[0]["params"]] == [default.params2d[0].shape] * 3
    for custom in (SmoothedAdamMLP(hidden=8), OwnSGDMLP(hidden=8)):
        _, fused = pools(custom, 3)
        assert list(map(id, fused.optimizer.param_groups[0]["params"])) == list(map(id, fused.fused_params))
    assert not default_recipe(torch.optim.SGD(default.fused_params[:1], **sgd_settings(OPTIM)), OPTIM, 2)


class ResNet20AtDefaultDtype(ResNet20):
    """ResNet-20 on the digits, whose pixels come in torch's default dtype (the weights do already)."""

    def data(self, shard: Shard) -> Any:
        data = super().data(shard)
        dtype = torch.get_default_dtype()
        data.x_train, data.x_val = data.x_train.to(dtype), data.x_val.to(dtype)
        return data


MODELS = {
    "mlp": lambda: MLP(hidden=32),
    "lenet": lambda: LeNet(),
    "resnet20": lambda: ResNet20AtDefaultDtype(dataset="digits"),
    "custom-loss-adam": lambda: SmoothedAdamMLP(hidden=32),
}


@pytest.fixture
def float64_for_resnet20(request: pytest.FixtureRequest) -> Iterator[None]:
    """float64 as the default dtype for ResNet-20: in float32 its BatchNorm over 2x2 maps of 8 samples can
    amplify the 1e-7 round-off of a grouped against a plain convolution past a ReLU's threshold, and then a
    learner's gradients part by up to 0.04 after one step (measured on an AMD EPYC host, learner 1 of 3; not
    on others). In float64 the engines agree to 1e-14 over all three steps."""
    before = torch.get_default_dtype()
    if request.node.callspec.params["name"] == "resnet20":
        torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_equals_serial_after_k_steps(name: str, m: int, float64_for_resnet20: None) -> None:
    serial, fused = pools(MODELS[name](), m)
    assert_rows_equal(serial, fused, "params")
    assert_rows_equal(serial, fused, "buffers")
    train_alongside(serial, fused)
    if name == "resnet20":  # the BatchNorm running statistics really moved
        assert not torch.equal(fused.learners[0].buffers, pools(MODELS[name](), 1)[1].learners[0].buffers)
    s, f = serial.take_stats(), fused.take_stats()
    assert s[2] == f[2] == STEPS * m * 8
    assert s[1] == f[1]
    assert f[0] == pytest.approx(s[0], rel=1e-5)
    assert serial.validate() == pytest.approx(fused.validate(), rel=1e-5)


def test_vgg_fused_forward_equals_each_replica() -> None:
    model = VGG(dataset="digits", width=0.125)
    torch.manual_seed(0)
    fused = FusedPool(model, PoolSpec(0, 1, 4, OPTIM, CPU, learners=2, fuse="always"))
    x = torch.randn(2, 4, 1, 8, 8)
    fused.fused.eval()
    with torch.no_grad():
        out = fused.fused(x)
        for j, learner in enumerate(fused.learners):
            learner.module.eval()
            torch.testing.assert_close(out[j], learner.module(x[j]), atol=1e-5, rtol=1e-4)


def test_rows_alias_the_fused_weights() -> None:
    model = MLP(hidden=16)
    torch.manual_seed(0)
    fused = FusedPool(model, PoolSpec(0, 1, 4, OPTIM, CPU, learners=3, fuse="always"))
    for j, learner in enumerate(fused.learners):
        assert learner.params.is_contiguous() and learner.params.ndim == 1
        assert learner.params.data_ptr() == fused.params2d[j].data_ptr()
        assert learner.grads.data_ptr() == fused.grads2d[j].data_ptr()
    x = torch.randn(1, 4, 1, 8, 8).expand(3, 4, 1, 8, 8)
    with torch.no_grad():
        before = fused.fused(x).clone()
        fused.learners[1].params.mul_(0.5)  # a rule writes row 1 only
        after = fused.fused(x)
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    assert not torch.allclose(after[1], before[1])


def test_state_moves_between_engines_by_rows() -> None:
    serial, fused = pools(LeNet(), 2)
    with torch.no_grad():
        for a, b in zip(serial.learners, fused.learners, strict=True):
            a.params.add_(torch.randn_like(a.params) * 0.1)
            b.params.copy_(a.params)
    assert serial.validate() == pytest.approx(fused.validate(), rel=1e-5)
    centre = serial.learners[1].params.clone()
    assert serial.validate(centre) == pytest.approx(fused.validate(centre), rel=1e-5)
    digits = serial.datas[0]
    assert serial.validate(data=digits) == pytest.approx(fused.validate(data=digits), rel=1e-5)


class SoftmaxNet(MLP):
    """An MLP ending in a layer the fuser does not know."""

    def module(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.Softmax(dim=1))


class MyLinear(nn.Linear):
    """A Linear subclass: its forward could differ, so it is not fused as a Linear."""


class SubclassNet(MLP):
    def module(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), MyLinear(64, 10))


def plain(factory: Any, shape: tuple[int, ...], classes: int, kind: type[DatasetModel] = DatasetModel) -> Any:
    """A plain network (no TorchModel) on random arrays of ``shape``: the model contract's module form
    (``kind``: DatasetModel or a subclass that changes the training recipe)."""
    gen = torch.Generator().manual_seed(1)
    sets = []
    for n in (96, 32):
        x, y = torch.randn(n, *shape, generator=gen), torch.randint(0, classes, (n,), generator=gen)
        sets.append(ArrayDataset(x, y, "random"))
        sets[-1].x = sets[-1].x.to(torch.get_default_dtype())
    return kind(factory, {}, *sets, LoaderOptions())


#: Networks outside the layer-by-layer fuser's set: they take the vmap path, and must equal serial too.
VMAP_MODELS = {
    "softmax-layer": SoftmaxNet,
    "linear-subclass": SubclassNet,
    "plain-module": lambda: plain(lambda: DigitsNet(hidden=16), (1, 8, 8), 10),
    "mnist1d-cnn": lambda: plain(MNIST1DCNN, (40,), 10),
    "resnet18-torchvision-layout": lambda: plain(lambda: resnet18(num_classes=4), (3, 32, 32), 4),
    "transformer-block": lambda: DatasetModel(
        TransformerBlock, {}, Tokens(96), Tokens(32, seed=1), LoaderOptions()
    ),
}


#: Batch norm over 1×1 maps of 8 samples amplifies float32 round-off to ~2e-3 of a gradient within three
#: steps (measured); in float64 both engines agree to 1e-13, so these run in float64.
FLOAT64 = {"resnet18-torchvision-layout"}


@pytest.fixture
def dtype_of(request: pytest.FixtureRequest) -> Iterator[None]:
    """float64 as the default dtype for the cases in FLOAT64, float32 otherwise."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if request.node.callspec.params["name"] in FLOAT64 else before)
    yield
    torch.set_default_dtype(before)


#: Cases that take tens of seconds on 2 cores (a float64 ResNet-18 epoch on both engines: 25-50 s): they run
#: in the full suite, out of the quick tier.
SLOW_CASES = {"resnet18-torchvision-layout"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in VMAP_MODELS]
)
def test_any_network_fuses_through_its_own_forward_and_equals_serial(
    name: str, caplog: pytest.LogCaptureFixture, dtype_of: None
) -> None:
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        serial, fused = pools(VMAP_MODELS[name](), 3)
        assert isinstance(fused.fused, ReplicatedNetwork)
        assert "the layers path cannot run this network (the fused engine cannot fuse" in caplog.text
        assert "next: replicated" in caplog.text
        # The whole epoch: the last steps replay the recorded forward (test_replay.py).
        train_alongside(serial, fused, fused.n_batch_train)
    assert fused.fused.replays.replayed >= 1, caplog.text
    assert isinstance(fused.fused, ReplicatedNetwork), caplog.text  # no vmap needed
    assert not fused.fused.looped, f"ran once per replica: {fused.fused.looped}"
    assert serial.take_stats()[1] == fused.take_stats()[1]
    assert serial.validate() == pytest.approx(fused.validate(), rel=1e-5)


@pytest.mark.parametrize("make_rule", [lambda: BSP(mode="grad"), lambda: SMA()], ids=["BSP", "SMA"])
def test_rules_run_unchanged_on_the_fused_pool(make_rule: Any) -> None:
    """STEPS steps of a rule on 2 ranks × 2 learners: the same replicas on both engines."""
    serial, fused = (
        run_world(2, make_rule, STEPS, optim=OPTIM, learners=2, engine=e) for e in (SerialPool, FusedPool)
    )
    for s, f, (start, _) in zip(serial.final, fused.final, fused.bound, strict=True):
        np.testing.assert_allclose(f, s, atol=ATOL, rtol=0)
        assert np.abs(f - start).max() > 1e-3  # the replicas really trained


class Signals(nn.Module):
    """1-D convolutions of every kind the lengthwise form takes (stride, dilation, padding, no bias) and one
    it leaves to the 2-D forms (grouped), between ReLUs, as a plain ``forward()``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(2, 6, 5, padding=1)
        self.conv2 = nn.Conv1d(6, 6, 3, stride=2, padding=2, dilation=2, bias=False)  # its input's gradient
        self.conv3 = nn.Conv1d(6, 4, 3, groups=2)
        self.linear = nn.Linear(4 * 7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.linear(F.relu(self.conv3(h)).flatten(1))


def test_both_conv1d_forms_match_serial() -> None:
    serial, fused = pools(plain(Signals, (2, 20), 3), 3)
    train_alongside(serial, fused)
    convs = [v for v in fused.fused.dispatcher.state.values() if isinstance(v, FusedConv1d)]
    assert [conv.form for conv in convs] == ["lengthwise", "lengthwise", "two_d"]  # grouped: the 2-D form
    recorded = json.loads(fused.run_record()["fused_choice"])["conv_forms"]  # the run's record has them
    assert [c["form"] for c in recorded.values()] == ["lengthwise", "lengthwise", "two_d"]
    assert serial.validate() == pytest.approx(fused.validate(), rel=1e-5)


def test_both_conv1d_forms_hand_their_output_on_in_the_same_layout() -> None:
    """The next layers see one layout whichever form a call site takes (a 2-D form's output in its own layout
    once made the MNIST-1D CNN's whole step slower)."""
    _, fused = pools(plain(Signals, (2, 20), 3), 2)
    fused.start_epoch(0)
    fused.compute(0)  # the call sites are built on the first training forward
    conv = next(v for v in fused.fused.dispatcher.state.values() if isinstance(v, FusedConv1d))
    x = torch.randn(2, 5, 2, 20)
    lengthwise, two_d = conv.lengthwise(x), conv.two_d(x)
    assert lengthwise.shape == two_d.shape and lengthwise.stride() == two_d.stride()
    torch.testing.assert_close(two_d, lengthwise, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["resnet20", "custom-loss-adam"])
def test_replicas_one_after_another_equal_serial(name: str) -> None:
    """``fuse = never``: the fused engine's unfused form (each replica on its own row, one flat optimizer)
    trains exactly as the serial engine, BatchNorm statistics and a custom loss and optimizer included."""
    serial, fused = pools(MODELS[name](), 3, fuse="never")
    train_alongside(serial, fused)
    assert fused.choice.chosen == "unfused"
    assert serial.take_stats() == pytest.approx(fused.take_stats(), rel=1e-6)


def test_auto_times_both_forms_then_keeps_one(caplog: pytest.LogCaptureFixture) -> None:
    """``fuse = auto``: the first steps alternate the two forms (both train the same replicas, so the pool
    stays equal to the serial engine throughout), then one form is kept and the decision is logged."""
    serial, fused = pools(MLP(hidden=32), 3, fuse="auto")
    ran = []
    serial.start_epoch(0)
    fused.start_epoch(0)
    warming, trial = [], fused.choice.steps_to_decide
    with caplog.at_level("INFO", logger="mpicrossbow.pool.fused.chooser"):
        for step in range(trial + 2):
            ran.append(fused.choice.form())
            warming.append(fused.warming_up)
            serial.compute(step)
            fused.compute(step)
            assert_rows_equal(serial, fused, "grads", GRAD_TOL)
            serial.apply()
            fused.apply()
    assert set(ran[:-2]) == {"fused", "unfused"} and ran[-1] == ran[-2] == fused.choice.chosen
    # The auto-tuner leaves the trial's steps out of its measurement (test_autotune.py).
    assert warming == [True] * trial + [False, False] and not serial.warming_up
    assert len(fused.choice.times["fused"]) == len(fused.choice.times["unfused"]) == fused.choice.rounds
    assert "ms fused (layers path)" in caplog.text and "ms unfused; runs" in caplog.text
    assert_rows_equal(serial, fused, "params")


def test_auto_runs_one_learner_unfused_without_a_trial() -> None:
    """One learner has nothing to fuse: ``fuse = auto`` keeps it the plain replica it is from step 0."""
    _, fused = pools(MLP(hidden=32), 1, fuse="auto")
    assert fused.choice.chosen == "unfused" and fused.choice.steps_to_decide == 0
    assert not fused.warming_up
