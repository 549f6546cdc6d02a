"""A fused forward recorded and replayed (:mod:`mpicrossbow.pool.fused.replay`): the same values and gradients
as the template's run, bit for bit, and never a replay of a forward whose Python could take another path.

Every network here runs through :class:`~mpicrossbow.pool.fused.replicated_network.ReplicatedNetwork` (its own
``forward()``); test_fused.py and test_replicated.py train each node kind and model through whole epochs,
the last steps replayed, against the serial engine.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fused import plain, pools
from torch import nn

from mpicrossbow.pool import FusedPool
from mpicrossbow.pool.fused.replay import OperatorRecorder
from mpicrossbow.pool.fused.replicated_network import ReplicatedNetwork

M = 3


def network(factory: Any) -> tuple[FusedPool, ReplicatedNetwork]:
    """A fused pool of M replicas of ``factory``'s network on 1×8×8 inputs, and its replicated network."""
    _, fused = pools(plain(factory, (1, 8, 8), 10), M)
    net = fused.fused
    assert isinstance(net, ReplicatedNetwork)
    net.train()
    return fused, net


def inputs(batch: int = 4) -> torch.Tensor:
    """Every replica's own batch."""
    return torch.randn(M, batch, 1, 8, 8, generator=torch.Generator().manual_seed(batch))


class MixedNet(nn.Module):
    """Dropout (random masks), layer norm, a value computed under ``torch.no_grad()``, a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.fc1(F.dropout(x.flatten(1), 0.25, self.training))))
        with torch.no_grad():
            scale = h.abs().mean(dim=1, keepdim=True) + 1
        return self.fc2(h / scale + h)


def test_a_replay_equals_the_template_run_bit_for_bit() -> None:
    fused, net = network(MixedNet)
    x = inputs()
    for _ in range(3):
        net(x)
    assert net.replays.ready == 1

    def step(run: Any) -> tuple[torch.Tensor, torch.Tensor]:
        fused.grads2d.zero_()
        torch.manual_seed(7)  # the same dropout masks
        out = run(x)
        out.square().sum().backward()
        return out.detach(), fused.grads2d.clone()

    before = net.replays.replayed
    replayed = step(net)
    assert net.replays.replayed == before + 1 and torch.is_grad_enabled()
    template = step(net._template_run)
    assert torch.equal(replayed[0], template[0]) and torch.equal(replayed[1], template[1])


def test_a_new_input_shape_is_recorded_apart_and_replays_too() -> None:
    _, net = network(MixedNet)
    net.eval()  # no dropout: outputs comparable call to call
    small, large = inputs(2), inputs(5)
    for _ in range(3):
        net(small)
        net(large)
    assert net.replays.ready == 2
    assert torch.equal(net(small), net._template_run(small))
    assert torch.equal(net(large), net._template_run(large))


class CoinNet(nn.Module):
    """Doubles its output on a coin drawn in Python from ``draw`` (a value read, or a random generator)."""

    def __init__(self, draw: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x.flatten(1))
        return y * 2 if self.draw() < 0.5 else y


@pytest.mark.parametrize(
    ("draw", "why"),
    [
        (lambda: torch.rand(()).item(), "item hands float to Python"),
        (random.random, "draws from Python's or NumPy's random generator"),
    ],
    ids=["tensor-value", "python-random"],
)
def test_a_forward_branching_on_a_draw_never_replays(
    draw: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    _, net = network(lambda: CoinNet(draw))
    net.eval()
    x = inputs()
    torch.manual_seed(0)
    random.seed(0)
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        outs = [net(x) for _ in range(8)]
    base = min(outs, key=lambda out: out.abs().sum().item())
    doubled = [torch.equal(out, base * 2) for out in outs]
    assert all(d or torch.equal(out, base) for d, out in zip(doubled, outs, strict=True))
    assert any(doubled) and not all(doubled)  # both branches taken: the coin was read each call
    assert net.replays.replayed == 0 and why in caplog.text


class CountingNet(nn.Module):
    """Scales its input by the number of calls so far: its operators' constants change every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x.flatten(1) * self.calls)


def test_a_forward_that_changes_every_call_stops_being_recorded(caplog: pytest.LogCaptureFixture) -> None:
    fused, net = network(CountingNet)
    x = inputs()
    replica = fused.learners[0].module
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        for call in range(1, 7):
            replica.calls = call - 1
            assert torch.equal(net(x)[0], replica(x[0]))
    assert net.replays.replayed == 0
    assert "its operators changed in each of 4 forwards in a row" in caplog.text


def test_module_hooks_run_every_forward_and_are_never_skipped() -> None:
    calls: list[int] = []

    def factory() -> nn.Module:
        module = nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.Softmax(dim=1))
        module[1].register_forward_hook(lambda *_: calls.append(1))
        return module

    _, net = network(factory)
    calls.clear()
    for _ in range(5):
        net(inputs())
    assert len(calls) == 5 and net.replays.replayed == 0


class Double(torch.autograd.Function):
    """Twice its input: a node whose forward runs with grad mode off, out of a recording's sight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class FunctionNet(nn.Module):
    """Scales its input by a tensor a custom autograd Function made."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1) * Double.apply(torch.full((64,), 0.5)))


MASK = torch.arange(64) % 3 == 0


class MaskedNet(nn.Module):
    """Keeps the features a boolean mask selects (a result shaped by values)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(int(MASK.sum()), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1)[:, MASK])


@pytest.mark.parametrize(
    ("factory", "why"),
    [
        (FunctionNet, "ran under a grad mode set out of sight"),
        (MaskedNet, "shapes its result by the values"),
    ],
    ids=["autograd-function", "boolean-mask"],
)
def test_what_a_recording_cannot_follow_runs_through_the_template(
    factory: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    fused, net = network(factory)
    net.eval()
    x = inputs()
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        outs = [net(x) for _ in range(4)]
    assert net.replays.replayed == 0 and why in caplog.text
    replica = fused.learners[1].module.eval()
    for out in outs:
        torch.testing.assert_close(out[1], replica(x[1]))


SCALE = [1.0]


class GlobalScaleNet(nn.Module):
    """Scales its input by a module-level setting (Python state a replay cannot see change)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1) * SCALE[0])


def test_an_epoch_start_records_the_forward_anew() -> None:
    fused, net = network(GlobalScaleNet)
    x = inputs()
    replica = fused.learners[2].module
    try:
        for _ in range(3):
            net(x)
        assert net.replays.ready == 1
        fused.start_epoch(1)  # nothing changed: one recording, equal to the last epoch's, resumes the replay
        assert net.replays.ready == 0
        net(x)
        assert net.replays.ready == 1
        SCALE[0] = 3.0  # a setting changed between epochs: recorded anew, then replayed with the new value
        fused.start_epoch(2)
        before = net.replays.replayed
        for _ in range(4):
            torch.testing.assert_close(net(x)[2], replica(x[2]))
        assert net.replays.replayed == before + 2
    finally:
        SCALE[0] = 1.0


class AutocastNet(nn.Module):
    """Its hidden layer under bfloat16 autocast, switched on inside the forward (out of the recorder's
    sight)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc1(x.flatten(1))
        return self.fc2(h.float())


def test_autocast_switched_inside_the_forward_is_never_replayed_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, net = network(AutocastNet)
    x = inputs()
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        outs = [net(x) for _ in range(4)]
    assert net.replays.replayed == 0 and "ran under autocast switched inside the forward" in caplog.text
    assert all(torch.equal(out, outs[0]) for out in outs)


def test_a_recording_that_fails_leaves_the_forward_running(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A recording is a speed-up only: a fault inside it costs the replay, never the forward."""

    def broken(*_: Any) -> None:
        raise KeyError("injected")

    monkeypatch.setattr(OperatorRecorder, "_note", broken)
    fused, net = network(MixedNet)
    net.eval()
    x = inputs()
    with caplog.at_level("INFO", logger="mpicrossbow.pool"):
        outs = [net(x) for _ in range(4)]
    assert net.replays.replayed == 0
    assert "could not be recorded (KeyError: 'injected')" in caplog.text
    replica = fused.learners[0].module.eval()
    for out in outs:
        torch.testing.assert_close(out[0], replica(x[0]))
