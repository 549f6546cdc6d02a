"""Runs of fused ``Linear`` layers and activations in an ``nn.Sequential``, each as one autograd node.

The layer-by-layer fuser turns each ``Linear`` into a :class:`~.fused_network.FusedLinear` and keeps
activations as they are. A run of them — Linear → activation → Linear …, an MLP's body, a CNN's classifier
head — is put here in place of its layers as one :class:`FusedChain`, run by
:func:`~.batched_chain.batched_chain`: one node instead of one per layer, the same arithmetic.

**Needed for speed** (benchmarks/pool.py, m = 8, one thread, side by side, by CPU time): without the chains
LeNet-28's fused ÷ bound at b = 4 fell from 1.08 to 0.93 in one run and from 0.92 to 0.82 in another, and
the MLP's, whose step by hand (:mod:`.chain_step`) is built on its chain, from 0.82 to 0.54 (b = 4) and
1.03 to 0.71 (b = 16). Not CPU-only: on a GPU the nodes and Python saved are per-step host time, and
writing the gradient rows in the matmul saves a pass over them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...errors import ContractError
from ..step_gradients import StepGradients
from .batched_chain import Steps, activation_kernels, batched_chain
from .fused_network import FusedLinear


def _steps(layers: Sequence[nn.Module]) -> Steps:
    """A chain's program: None for a fused Linear (its weight and bias are the next two weights), else the
    activation's kernels."""
    return [None if isinstance(layer, FusedLinear) else activation_kernels(layer) for layer in layers]


class FusedChain(nn.Module):
    """Fused ``Linear`` layers and activations of an ``nn.Sequential``, run as one autograd node.

    Built by the fuser from a run of at least two layers of which one is a Linear; the Linear layers keep
    their fused parameters (so the pool's flat rows are unchanged) and the chain only changes how the run is
    differentiated.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)  # the fused parameters stay registered where they were
        #: The chain's program (see :data:`~.batched_chain.Steps`).
        self.steps = _steps(layers)
        #: Each Linear's fused weight and bias (or None), in order: the chain's parameters.
        self.weights = [
            t for layer in layers if isinstance(layer, FusedLinear) for t in (layer.weight, layer.bias)
        ]
        #: The pool's gradients, which the backward puts its weights' gradients into (set by the pool).
        self.sink: StepGradients | None = None

    @staticmethod
    def joins(layer: nn.Module) -> bool:
        """Whether a fused layer can be part of a chain (a fused Linear, or a known activation)."""
        return isinstance(layer, FusedLinear) or activation_kernels(layer) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every replica's run of layers at once, ``(m, N, in) → (m, N, out)``."""
        if x.ndim != 3:
            raise ContractError(f"fused Linear expects (m, N, features) inputs, got shape {tuple(x.shape)}")
        return batched_chain(self.steps, x, self.weights, self.sink)


def chain_runs(network: nn.Module) -> int:
    """Replace, in every ``nn.Sequential`` of the fused ``network`` (in place), each run of chainable layers
    that holds a Linear and has two or more members by one :class:`FusedChain`; the number of chains made."""
    made = 0
    for module in list(network.modules()):
        if isinstance(module, nn.Sequential):
            layers = _chained(list(module))
            made += sum(isinstance(layer, FusedChain) for layer in layers) - sum(
                isinstance(layer, FusedChain) for layer in module
            )
            for name in list(module._modules):
                del module._modules[name]
            for i, layer in enumerate(layers):
                module.add_module(str(i), layer)
    return made


def _chained(layers: list[nn.Module]) -> list[nn.Module]:
    """``layers`` with their chainable runs (see :func:`chain_runs`) as :class:`FusedChain` modules."""
    out: list[nn.Module] = []
    run: list[nn.Module] = []
    for layer in [*layers, None]:
        if layer is not None and FusedChain.joins(layer):
            run.append(layer)
            continue
        if len(run) >= 2 and any(isinstance(r, FusedLinear) for r in run):
            out.append(FusedChain(run))
        else:
            out.extend(run)
        run = []
        if layer is not None:
            out.append(layer)
    return out
