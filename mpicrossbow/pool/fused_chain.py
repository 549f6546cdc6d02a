"""A run of fused ``Linear`` layers and activations as one autograd node: the MLP's whole body in one step.

The fused engine turns m replicas' ``Linear`` into one batched matmul (:class:`~.fuse.FusedLinear`). For a
small network the matmuls are cheap and the step is dominated by what surrounds them: an autograd node per
layer and per activation, a Python ``Function`` per Linear (so that ``∂W`` comes out in the weight's own
layout, see :class:`~.fuse._BatchedLinear`), and their bookkeeping. A run of ``Linear`` → activation →
``Linear`` … in an ``nn.Sequential`` (an MLP, the classifier head of a CNN) is therefore run here as one
``torch.autograd.Function`` whose backward walks the run itself: per layer one ``threshold_backward`` (or the
activation's own backward kernel), one batched matmul for ``∂W``, one sum for ``∂b`` and one batched matmul
for ``∂x``. Measured in the training loop at m = 8, batch 4, one thread, side by side with the bound (one
replica at batch 32): a fused MLP 64-128-128-10 step went from 517 to 466 µs (fused ÷ bound 0.65 → 0.72),
a fused LeNet-28 step, whose classifier head is such a run, from 4.02 to 3.58 ms (0.81 → 0.88).

The gradients are returned to autograd, which accumulates them into the parameters' ``.grad`` views like any
other node's: post-accumulate hooks (a rule overlapping its exchange with the backward),
``torch.autograd.grad`` (the form chooser's timing) and gradient accumulation behave as for the unchained
layers. The arithmetic is the unchained layers', operation for operation, so the two agree to float
round-off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import ContractError
from .fuse import FusedLinear

_Forward = Callable[[torch.Tensor], torch.Tensor]
#: ``backward(grad, saved)`` where ``saved`` is the activation's input or output (see :class:`Kernels`).
_Backward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Kernels(NamedTuple):
    """An activation's forward and backward, and whether the backward reads its output (else its input)."""

    forward: _Forward
    backward: _Backward
    on_output: bool


def activation_kernels(layer: nn.Module) -> Kernels | None:
    """The kernels of an activation layer that can join a chain (exact types only: a subclass may override
    ``forward``); None for any other layer, which ends a chain."""
    kind = type(layer)
    if kind is nn.ReLU:
        return Kernels(torch.relu, lambda g, y: torch.ops.aten.threshold_backward(g, y, 0), True)
    if kind is nn.Tanh:
        return Kernels(torch.tanh, torch.ops.aten.tanh_backward, True)
    if kind is nn.Sigmoid:
        return Kernels(torch.sigmoid, torch.ops.aten.sigmoid_backward, True)
    if kind is nn.SiLU:
        return Kernels(F.silu, torch.ops.aten.silu_backward, False)
    if kind is nn.GELU:
        approximate = layer.approximate
        return Kernels(
            lambda x: F.gelu(x, approximate=approximate),
            lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate=approximate),
            False,
        )
    if kind is nn.LeakyReLU:
        slope = layer.negative_slope
        return Kernels(
            lambda x: F.leaky_relu(x, slope),
            lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, slope, False),
            False,
        )
    if kind is nn.Identity:
        return Kernels(lambda x: x, lambda g, _: g, True)
    return None


#: The activation types :func:`activation_kernels` knows.
ACTIVATIONS = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.GELU, nn.LeakyReLU, nn.Identity)


def _steps(layers: Sequence[nn.Module]) -> list[Kernels | None]:
    """A chain's program: None for a fused Linear (its weight and bias are the next two weights), else the
    activation's kernels."""
    return [None if isinstance(layer, FusedLinear) else activation_kernels(layer) for layer in layers]


class _ChainFunction(torch.autograd.Function):
    """Forward and backward of a run of batched affine maps and activations, ``(m, N, in) → (m, N, out)``."""

    @staticmethod
    def forward(
        ctx: Any, steps: Sequence[Kernels | None], x: torch.Tensor, *weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Every step in turn; keeps each Linear's input and each activation's input or output."""
        saved: list[torch.Tensor] = []
        h, k = x, 0
        for step in steps:
            if step is None:
                weight, bias = weights[k], weights[k + 1]
                assert weight is not None
                k += 2
                saved.append(h)
                if bias is None:
                    h = torch.bmm(h, weight.transpose(1, 2))
                else:
                    h = torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))
            elif step.on_output:
                h = step.forward(h)
                saved.append(h)
            else:
                saved.append(h)
                h = step.forward(h)
        ctx.steps, ctx.saved, ctx.weights = steps, saved, weights
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The steps backwards: ``∂x = ∂y @ W``, ``∂W = ∂yᵀ @ x`` (the weight's layout), ``∂b = Σₙ ∂y``."""
        steps, saved, weights = ctx.steps, ctx.saved, ctx.weights
        grads: list[torch.Tensor | None] = [None] * len(weights)
        k = len(weights)
        for i in range(len(steps) - 1, -1, -1):
            step, kept = steps[i], saved[i]
            if step is not None:
                grad = step.backward(grad, kept)
                continue
            k -= 2
            weight, bias = weights[k], weights[k + 1]
            if ctx.needs_input_grad[2 + k]:
                grads[k] = torch.bmm(grad.transpose(1, 2), kept)
            if bias is not None and ctx.needs_input_grad[3 + k]:
                grads[k + 1] = grad.sum(1)
            if i > 0 or ctx.needs_input_grad[1]:
                grad = torch.bmm(grad, weight)
            else:
                grad = None
        return (None, grad, *grads)


class FusedChain(nn.Module):
    """Fused ``Linear`` layers and activations of an ``nn.Sequential``, run as one autograd node.

    Built by the fuser from a run of at least two layers of which one is a Linear; the Linear layers keep
    their fused parameters (so the pool's flat rows are unchanged) and the chain only changes how the run is
    differentiated.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)  # the fused parameters stay registered where they were
        self._steps = _steps(layers)
        self._weights = [
            t for layer in layers if isinstance(layer, FusedLinear) for t in (layer.weight, layer.bias)
        ]

    @staticmethod
    def joins(layer: nn.Module) -> bool:
        """Whether a fused layer can be part of a chain (a fused Linear, or a known activation)."""
        return isinstance(layer, FusedLinear) or activation_kernels(layer) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every replica's run of layers at once, ``(m, N, in) → (m, N, out)``."""
        if x.ndim != 3:
            raise ContractError(f"fused Linear expects (m, N, features) inputs, got shape {tuple(x.shape)}")
        return _ChainFunction.apply(self._steps, x, *self._weights)


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
