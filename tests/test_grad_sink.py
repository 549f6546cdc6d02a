"""Chains putting their gradients straight into the rows during the pool's step (pool/step_gradients.py).

Inside a network trained through autograd (here a BatchNorm before the chain), the chain's weights get their
gradients from the chain itself, not from autograd's accumulation: every watcher must still hear every
parameter once, the chain's as soon as the chain is done; the gradients must equal the serial engine's; and
outside the pool's step the chain must behave as any node.
"""

from __future__ import annotations

import pytest
import torch
from test_fused import plain, pools, train_alongside
from torch import nn

from mpicrossbow.pool.fused.fused_chain import FusedChain
from mpicrossbow.pool.step_gradients import StepGradients


def normed() -> object:
    """Linear → BatchNorm → (ReLU → Linear → ReLU → Linear): the chain's input comes through autograd."""
    return plain(
        lambda: nn.Sequential(
            nn.Flatten(),
            nn.Linear(12, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Linear(16, 16),
            nn.ReLU(),
            nn.Linear(16, 3),
        ),
        (12,),
        3,
    )


def test_a_chain_inside_an_autograd_step_equals_serial() -> None:
    serial, fused = pools(normed(), 3)
    assert fused._chain_step is None, "not one chain: the step goes through autograd"
    assert len([c for c in fused.fused.modules() if isinstance(c, FusedChain)]) == 1
    train_alongside(serial, fused)


def test_watchers_hear_every_parameter_once_the_chain_before_what_precedes_it() -> None:
    _, fused = pools(normed(), 2)
    first = fused.fused_params[0]  # the Linear before the BatchNorm: its gradient comes last
    heard: list[tuple[int, int, bool]] = []
    unwatch = fused.watch_gradients(lambda i, m: heard.append((i, m, bool(first.grad.any()))))
    fused.start_epoch(0)
    fused.compute(0)
    unwatch()
    assert sorted((i, m) for i, m, _ in heard) == [(i, 2) for i in range(len(fused.fused_params))]
    chain = {i for i, p in enumerate(fused.fused_params) if id(p) in fused._sunk}
    assert len(chain) == 4
    assert all(not before for i, _, before in heard if i in chain), "a chain weight was announced late"


def test_outside_the_pools_step_a_chain_returns_its_gradients() -> None:
    _, fused = pools(normed(), 2)
    out = fused.fused(torch.randn(2, 5, 12))
    out.sum().backward()  # the sink is closed: autograd accumulates as for any node
    assert fused.grads2d.abs().sum() > 0
    assert not fused._gradients.active


def test_the_rows_close_when_the_backward_fails() -> None:
    gradients = StepGradients(torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="does not require grad"):
        gradients.backward(torch.ones(()))
    assert not gradients.active
