"""The fused engine's path for any network, node kind by node kind: each equals the serial engine.

Every case is a small network built around one kind of operator; the fused pool (``fuse = always``) must
train exactly as the serial engine for a few steps (gradients every step, weights and running statistics
after; test_fused.py's ``train_alongside``), run that operator for all replicas at once (nothing looped
once per replica unless the case says so) and never need ``torch.func.vmap``. Then what the path cannot
follow: an operator with no fused form runs once per replica (logged), and a forward it cannot follow falls
back to vmap with the running statistics of the failed attempt restored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fused import plain, pools, train_alongside
from torch import nn

from models.imagenet_resnet import resnet50
from models.transformer import Tokens
from mpicrossbow.config import OptimSection
from mpicrossbow.data.dataset_model import DatasetModel
from mpicrossbow.data.loader import LoaderOptions
from mpicrossbow.pool import FusedPool
from mpicrossbow.pool.fused.replicated_network import ReplicatedNetwork
from mpicrossbow.pool.fused.vmapped import VmappedNetwork
from mpicrossbow.pool.spec import PoolSpec


class Conv1dNet(nn.Module):
    """Conv1d (strided, grouped), BatchNorm1d over (N, C, L), MaxPool1d, AdaptiveAvgPool1d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 8, 3, stride=2, padding=1)
        self.grouped = nn.Conv1d(8, 8, 3, padding=1, groups=2)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool1d(torch.relu(self.norm(self.grouped(self.conv(x)))), 2)
        return self.head(F.adaptive_avg_pool1d(h, 1).flatten(1))


class Conv2dNet(nn.Module):
    """Conv2d, BatchNorm2d, GroupNorm, a residual forward, AvgPool2d, AdaptiveAvgPool2d, torch.flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 6)
        self.fc = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv1(x)))
        h = F.relu(self.gn(self.conv2(h)) + h)
        h = F.avg_pool2d(h, 2)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


class Conv3dNet(nn.Module):
    """Conv3d (grouped too) and BatchNorm3d on volumes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 4, 3, padding=1)
        self.grouped = nn.Conv3d(4, 4, 3, stride=2, padding=1, groups=2, bias=False)
        self.norm = nn.BatchNorm3d(4)
        self.fc = nn.Linear(4 * 2 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.norm(self.grouped(F.relu(self.conv(x))))).flatten(1))


class ShapesNet(nn.Module):
    """view, reshape, unflatten, permute, transpose, cat, chunk, pad, indexing, unsqueeze, zeros_like, matmul
    of two activations, softmax and a parameter used in arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        h = self.proj(x.view(n, -1)).unflatten(1, (4, 4))  # (N, 4, 4)
        h = h * self.scale + h.permute(0, 2, 1)
        a, b = h.chunk(2, dim=-1)
        h = torch.cat([a, b], dim=2).transpose(1, 2)
        h = F.pad(h, (0, 1))[..., :4] + torch.zeros_like(h)
        attn = torch.softmax(h @ h.mT, dim=-1)
        h = (attn @ h)[:, :3].unsqueeze(1).reshape(n, 12)
        return self.head(h)


class TokenNet(nn.Module):
    """Embedding, LayerNorm, nn.MultiheadAttention (self-attention, batch first), a functional
    scaled_dot_product_attention, GELU, dropout and a mean over tokens."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Dropout(0.0), nn.Linear(32, width))
        self.head = nn.Linear(width, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = self.norm(h + a)
        q = h.view(*h.shape[:2], 2, 8).transpose(1, 2)
        h = h + F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(h.shape)
        return self.head(self.ff(h).mean(dim=1))


class SequenceFirstNet(nn.Module):
    """nn.MultiheadAttention in its sequence-first layout, ``(length, N, width)``: the replicas' values
    reach it contiguous (the batch-first module hands it a transposed view)."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = nn.MultiheadAttention(width, 4)
        self.head = nn.Linear(width, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens.t())  # (length, N, width)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((h + a).mean(dim=0))


def tokens(factory: Callable[[], nn.Module]) -> Any:
    """``factory``'s network on random token sequences."""
    return DatasetModel(factory, {}, Tokens(96), Tokens(32, seed=1), LoaderOptions())


CASES: dict[str, Callable[[], Any]] = {
    "conv1d-batchnorm1d-pool1d": lambda: plain(Conv1dNet, (2, 16), 3),
    "conv2d-batchnorm-groupnorm-residual-pool2d": lambda: plain(Conv2dNet, (1, 8, 8), 10),
    "conv3d-batchnorm3d": lambda: plain(Conv3dNet, (1, 4, 4, 4), 3),
    "shapes-and-functional-calls": lambda: plain(ShapesNet, (4, 4), 5),
    "embedding-layernorm-attention": lambda: tokens(TokenNet),
    "sequence-first-attention": lambda: tokens(SequenceFirstNet),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_node_kind_fuses_and_equals_serial(name: str) -> None:
    serial, fused = pools(CASES[name](), 3)
    assert isinstance(fused.fused, ReplicatedNetwork)
    train_alongside(serial, fused, fused.n_batch_train)  # the last steps replay the recorded forward
    assert fused.fused.replays.replayed >= 1
    assert isinstance(fused.fused, ReplicatedNetwork) and fused.choice.path == "replicated"
    assert not fused.fused.looped, f"ran once per replica: {fused.fused.looped}"
    assert serial.take_stats()[1] == fused.take_stats()[1]


@pytest.mark.slow
def test_resnet50_in_torchvision_layout_runs_fused_and_equals_each_replica() -> None:
    """ResNet-50's Bottleneck blocks (1×1 and strided 3×3 convolutions, downsampling shortcuts): the fused
    training forward of 2 replicas equals each replica's own, every operator fused. (Training is what the
    ResNet-18 case of test_fused.py checks; ResNet-50's 2 × 25.6 M parameters make its training slow here.
    64×64 images keep layer4's maps at 2×2: batch norm over 1×1 maps of 2 samples turns float round-off
    into differences of order 1, in float64 too, measured.)"""
    torch.manual_seed(0)
    model = plain(lambda: resnet50(num_classes=4), (3, 64, 64), 4)
    fused = FusedPool(
        model, PoolSpec(0, 1, 2, OptimSection(), torch.device("cpu"), learners=2, fuse="always")
    )
    x = torch.randn(2, 2, 3, 64, 64)
    fused.fused.train()
    out = fused.fused(x)
    assert not fused.fused.looped
    for j, learner in enumerate(fused.learners):
        learner.module.train()
        torch.testing.assert_close(out[j], learner.module(x[j]), rtol=1e-3, atol=1e-3)


class DropoutNet(nn.Module):
    """Dropout on the input, then a linear map."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(x.flatten(1)))


def test_dropout_draws_a_mask_per_replica() -> None:
    _, fused = pools(plain(DropoutNet, (1, 8, 8), 10), 3)
    fused.params2d.copy_(fused.params2d[0].expand_as(fused.params2d))  # three identical replicas
    x = torch.randn(1, 4, 1, 8, 8).expand(3, 4, 1, 8, 8)
    fused.fused.train()
    out = fused.fused(x)
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])
    fused.fused.eval()
    out = fused.fused(x)
    assert torch.equal(out[0], out[1])


class CumulativeNet(nn.Module):
    """An operator without a fused form (cumulative product)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cumprod(torch.sigmoid(x.flatten(1)), dim=1))


def test_an_operator_without_a_fused_form_runs_once_per_replica(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        serial, fused = pools(plain(CumulativeNet, (1, 8, 8), 10), 3)
        train_alongside(serial, fused)
    assert fused.fused.looped == {"cumprod"} and isinstance(fused.fused, ReplicatedNetwork)
    assert "cumprod has no fused form here, so it runs once per replica" in caplog.text


class ValueBranchNet(nn.Module):
    """Batch norm first (its running statistics move), then a branch on the values: vmap's case."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.flatten(1))
        return self.fc(torch.where(h > 0, h, -h)) if bool(h.sum() > -1e9) else self.fc(h)


class DerivedWeightNet(nn.Module):
    """A weight transformed outside any operator on the input (it would carry replica 0's values)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) @ self.weight.t()


def test_a_forward_it_cannot_follow_falls_back_to_vmap(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        serial, fused = pools(plain(DerivedWeightNet, (1, 8, 8), 10), 3)
        train_alongside(serial, fused)
    assert isinstance(fused.fused, VmappedNetwork) and fused.choice.chosen == "fused"
    assert list(fused.choice.refused) == ["layers", "replicated"] and fused.choice.path == "vmapped"
    assert "computed from a parameter" in caplog.text and "next: vmapped" in caplog.text


def test_a_network_no_fused_form_runs_trains_its_replicas_one_after_another(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Neither path follows a branch on values: the pool trains unfused, exactly as serial, and the batch
    norm statistics the failed attempts moved are restored first."""
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        serial, fused = pools(plain(ValueBranchNet, (1, 8, 8), 10), 3)
        train_alongside(serial, fused)
    assert fused.choice.chosen == "unfused"
    assert "branches on a tensor's values" in caplog.text
    assert list(fused.choice.refused) == ["layers", "replicated", "vmapped"]
    assert "the vmapped path cannot run this network (vmap:" in caplog.text and "next: unfused" in caplog.text


def test_an_embedding_index_out_of_range_is_an_error_as_in_the_serial_engine() -> None:
    """Indexing counts a negative index from the end: the embedding rule refuses it, as F.embedding does."""
    table = nn.Embedding(5, 3)
    with pytest.raises(IndexError):
        table(torch.tensor([[1, -1]]))
    _, fused = pools(
        plain(lambda: nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(6, 2)), (2,), 2), 2
    )
    net = fused.fused
    assert isinstance(net, ReplicatedNetwork)
    fine = net(torch.tensor([[[1, 4]], [[0, 2]]]))
    assert fine.shape == (2, 1, 2)
    with pytest.raises(IndexError, match="out of bounds"):
        net(torch.tensor([[[1, -1]], [[0, 2]]]))
    with pytest.raises(IndexError, match="out of bounds"):
        net(torch.tensor([[[1, 5]], [[0, 2]]]))
