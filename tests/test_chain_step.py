"""A one-chain fused network stepped by hand instead of by autograd (mpicrossbow/pool/fused/chain_step.py).

The step by hand is an optimisation only: its losses, gradients and weights must be the autograd path's to
the bit, the gradients it writes must not keep anything of the last step, and a rule that overlaps its
exchange with the backward must hear of every gradient, last layer first, as autograd's hooks tell it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fused import plain, pools, train_alongside
from test_fused_chain import mlp
from torch import nn

from mpicrossbow.data.dataset_model import DatasetModel
from mpicrossbow.errors import ContractError
from mpicrossbow.pool import FusedPool
from mpicrossbow.pool.fused.chain_step import ChainStep
from mpicrossbow.pool.step_gradients import grad_rows

STEPS = 4


def twins(model: Any, m: int) -> tuple[FusedPool, FusedPool]:
    """Two fused pools of ``model`` that start equal: the first steps by hand, the second through autograd."""
    _, by_hand = pools(model, m)
    _, autograd = pools(model, m)
    assert by_hand._chain_step is not None
    autograd._chain_step = None
    return by_hand, autograd


@pytest.mark.parametrize(
    ("activation", "bias"),
    [(nn.ReLU, True), (nn.GELU, True), (nn.Tanh, False)],
    ids=["relu", "gelu", "no-bias"],
)
def test_the_step_by_hand_equals_autograd_to_the_bit(activation: type[nn.Module], bias: bool) -> None:
    by_hand, autograd = twins(mlp(activation, bias), 3)
    for pool in (by_hand, autograd):
        pool.start_epoch(0)
    for step in range(STEPS):
        for pool in (by_hand, autograd):
            pool.compute(step)
        assert torch.equal(by_hand.grads2d, autograd.grads2d), f"step {step}: gradients differ"
        assert torch.equal(by_hand._last_losses, autograd._last_losses), f"step {step}: losses differ"
        for pool in (by_hand, autograd):
            pool.apply()
    assert torch.equal(by_hand.params2d, autograd.params2d)
    assert by_hand.learner_stats() == autograd.learner_stats()


def test_ignored_targets_count_for_nothing_as_through_autograd() -> None:
    """Targets of -100 (cross-entropy's ignore_index) get no gradient and no loss, as in the autograd step."""
    by_hand, autograd = twins(mlp(nn.ReLU), 2)
    x = torch.randn(2, 5, 12)
    y = torch.randint(0, 3, (2, 5))
    y[0, 1] = y[1, 4] = -100
    losses_by_hand, _ = by_hand._fused_step(x, y)
    losses_autograd, _ = autograd._fused_step(x, y)
    assert torch.equal(losses_by_hand, losses_autograd)
    assert torch.equal(by_hand.grads2d, autograd.grads2d)


def test_the_gradients_are_this_steps_alone() -> None:
    """The pool does not zero the rows before a step by hand: every gradient must be overwritten."""
    by_hand, autograd = twins(mlp(nn.ReLU), 2)
    for pool in (by_hand, autograd):
        pool.start_epoch(0)
        pool.grads2d.fill_(1e3)  # a stale gradient, e.g. of a step whose update a rule skipped
        pool.compute(0)
    assert torch.equal(by_hand.grads2d, autograd.grads2d)


def test_the_watchers_hear_the_last_layer_before_the_first_is_computed() -> None:
    """BSP's buckets start their allreduce on ready(i, m): the step must call it as each layer finishes."""
    by_hand, _ = twins(mlp(nn.ReLU), 2)
    first_weight = by_hand.fused_params[0]
    heard: list[tuple[int, int, bool]] = []
    unwatch = by_hand.watch_gradients(lambda i, m: heard.append((i, m, bool(first_weight.grad.any()))))
    by_hand.start_epoch(0)
    by_hand.compute(0)
    unwatch()
    last = len(by_hand.fused_params) - 1
    assert sorted((i, m) for i, m, _ in heard) == [(i, 2) for i in range(last + 1)]
    assert heard[0][0] in (last - 1, last) and not heard[0][2], "the last layer was not announced first"
    by_hand.compute(1)
    assert len(heard) == last + 1, "heard after unwatch()"


class Smoothed(DatasetModel):
    """A recipe whose loss is not the default cross-entropy (label smoothing)."""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, label_smoothing=0.1)


def test_only_one_chain_under_the_default_loss_is_stepped_by_hand() -> None:
    dropout_between = plain(
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.Dropout(0.0), nn.ReLU(), nn.Linear(8, 3)),
        (12,),
        3,
    )
    _, fused = pools(dropout_between, 2)
    assert ChainStep.of(fused.fused) is None and fused._chain_step is None
    _, smoothed = pools(mlp(nn.ReLU, kind=Smoothed), 2)
    assert ChainStep.of(smoothed.fused) is not None, "the network is one chain"
    assert smoothed._chain_step is None, "but its loss is not the default"
    serial, smoothed = pools(mlp(nn.ReLU, kind=Smoothed), 2)
    train_alongside(serial, smoothed)


def test_class_probability_targets_go_through_autograd() -> None:
    by_hand, _ = twins(mlp(nn.ReLU), 2)
    assert by_hand._chain_step is not None
    assert by_hand._chain_step.serves(torch.zeros(2, 5, dtype=torch.long))
    assert not by_hand._chain_step.serves(torch.zeros(2, 5, 3))


def test_a_weight_without_gradient_rows_is_an_error_naming_it() -> None:
    """A chain writes into its weights' ``.grad`` rows; a weight with none is refused, not skipped."""
    weight = torch.zeros(2, 3, 4, requires_grad=True)
    with pytest.raises(ContractError, match=r"\.grad rows, and one has none"):
        grad_rows([weight, None])
    weight.grad = torch.zeros_like(weight)
    rows = grad_rows([weight, None])
    assert rows[0] is weight.grad and rows[1] is None
