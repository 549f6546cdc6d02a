"""Runs of fused Linear layers and activations differentiated as one node
(mpicrossbow/pool/fused/fused_chain.py).

A chain changes only how the run is differentiated, so the fused pool must still equal the serial engine
step for step; its gradients must reach the parameters through autograd's accumulation (hooks fire,
``torch.autograd.grad`` leaves ``.grad`` alone); and only runs worth chaining are chained.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_fused import plain, pools, train_alongside
from torch import nn

from models.lenet import LeNet
from mpicrossbow.data.dataset_model import DatasetModel
from mpicrossbow.pool.fused.batched_chain import ACTIVATIONS
from mpicrossbow.pool.fused.fused_chain import FusedChain, chain_runs


def mlp(activation: type[nn.Module], bias: bool = True, kind: type[DatasetModel] = DatasetModel) -> Any:
    """A plain Sequential MLP on random 12-feature vectors, 3 classes: one chain of five layers."""
    return plain(
        lambda: nn.Sequential(
            nn.Flatten(),
            nn.Linear(12, 16),
            activation(),
            nn.Linear(16, 16, bias=bias),
            activation(),
            nn.Linear(16, 3),
        ),
        (12,),
        3,
        kind,
    )


def chains(network: nn.Module) -> list[FusedChain]:
    """The chains in a fused network."""
    return [module for module in network.modules() if isinstance(module, FusedChain)]


@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=lambda a: a.__name__)
def test_a_chained_mlp_equals_serial(activation: type[nn.Module]) -> None:
    serial, fused = pools(mlp(activation), 3)
    assert len(chains(fused.fused)) == 1
    train_alongside(serial, fused)


def test_a_chain_without_bias_equals_serial() -> None:
    serial, fused = pools(mlp(nn.ReLU, bias=False), 2)
    assert len(chains(fused.fused)) == 1
    train_alongside(serial, fused)


def test_only_runs_that_hold_a_linear_and_more_are_chained() -> None:
    serial, fused = pools(
        plain(
            lambda: nn.Sequential(
                nn.Flatten(),
                nn.Linear(12, 16),  # alone before the Dropout: not chained
                nn.Dropout(0.0),
                nn.ReLU(),  # activations alone: not chained
                nn.Dropout(0.0),
                nn.Linear(16, 16),  # Linear → ReLU → Linear: one chain
                nn.ReLU(),
                nn.Linear(16, 3),
            ),
            (12,),
            3,
        ),
        2,
    )
    body = fused.fused.body
    assert [type(layer).__name__ for layer in body] == [
        "FusedFlatten",
        "FusedLinear",
        "Dropout",
        "ReLU",
        "Dropout",
        "FusedChain",
    ]
    assert len(body[-1].layers) == 3
    assert chain_runs(fused.fused) == 0  # a chained network has nothing more to chain
    train_alongside(serial, fused)


def test_chained_gradients_fire_the_post_accumulate_hooks() -> None:
    """A rule overlapping its exchange with the backward (BSP) is told of every chained parameter."""
    _, fused = pools(mlp(nn.ReLU), 2)
    seen: list[tuple[int, int]] = []
    unwatch = fused.watch_gradients(lambda i, m: seen.append((i, m)))
    fused.start_epoch(0)
    fused.compute(0)
    unwatch()
    assert sorted(seen) == [(i, 2) for i in range(len(fused.fused_params))]
    assert fused.grads2d.abs().sum() > 0


def test_autograd_grad_through_a_chain_leaves_the_gradients_alone() -> None:
    """The form chooser times backward passes with torch.autograd.grad: they must not touch .grad."""
    _, fused = pools(mlp(nn.Tanh), 2)
    x = torch.randn(2, 5, 12, requires_grad=True)
    out = fused.fused(x)
    grads = torch.autograd.grad(out.sum(), [x, *fused.fused_params])
    assert not fused.grads2d.any()
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_a_step_through_autograd_zeroes_only_what_no_chain_writes() -> None:
    """LeNet's classifier head is a chain under autograd: its columns are written, not zeroed and added, and
    stale values left anywhere in the rows do not reach a step's gradients."""
    serial, fused = pools(LeNet(), 2)
    head = fused.grads2d.shape[1] - sum(block.shape[1] for block in fused._added)
    assert head == sum(
        w.numel() // 2 for chain in chains(fused.fused) for w in chain.weights if w is not None
    )
    fused.grads2d.fill_(float("nan"))
    train_alongside(serial, fused)


def tied() -> nn.Module:
    """An MLP whose chain uses one Linear twice (a weight shared by two layers); the Dropout before it keeps
    it off the step by hand (:mod:`mpicrossbow.pool.fused.chain_step`): its step runs through autograd."""
    shared = nn.Linear(12, 12)
    return nn.Sequential(
        nn.Flatten(), nn.Dropout(0.0), shared, nn.ReLU(), shared, nn.Tanh(), nn.Linear(12, 3)
    )


def test_a_chain_weight_used_twice_keeps_the_rows_zeroed_whole() -> None:
    """A weight a chain shares with another layer gets a sum of gradients: the rows are zeroed whole."""
    serial, fused = pools(plain(tied, (12,), 3), 2)
    assert chains(fused.fused) and fused._added is None
    train_alongside(serial, fused)


def tied_bare() -> nn.Module:
    """The tied MLP without the Dropout: only flattening before its chain, the shape the step by hand
    takes — which writes each weight's gradient once, so it must leave a weight used twice to autograd."""
    shared = nn.Linear(12, 12)
    return nn.Sequential(nn.Flatten(), shared, nn.ReLU(), shared, nn.Tanh(), nn.Linear(12, 3))


def test_a_weight_used_twice_is_not_stepped_by_hand() -> None:
    """The step by hand writes a weight's gradient from one use: for a weight two layers share it would
    lose the other's part (0.10 off serial here before it refused them); the step goes through autograd."""
    from mpicrossbow.pool.fused.chain_step import ChainStep

    serial, fused = pools(plain(tied_bare, (12,), 3), 2)
    assert chains(fused.fused) and ChainStep.of(fused.fused) is None
    train_alongside(serial, fused)
