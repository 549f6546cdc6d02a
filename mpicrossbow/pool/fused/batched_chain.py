"""Batched affine maps and activations over the replica dimension, differentiated as one autograd node.

The fused engine computes m replicas' ``Linear`` as one batched matmul, ``(m, N, in) @ (m, in, out)``. A
whole *chain* — Linear, activation, Linear, … — runs here in one forward and one backward: for a small
network the matmuls are cheap and what surrounds them (a node per layer and per activation, their Python)
decides the step. Per Linear the backward is one batched matmul for ``∂W = ∂yᵀ @ x`` (in the weight's own
layout, where autograd's ``baddbmm`` backward hands the strided ``.grad`` views a transpose), one sum for
``∂b`` and one for ``∂x``; per activation its own backward kernel. While the pool's backward runs the
weights' gradients go straight into their rows (:mod:`.step_gradients`); otherwise (``torch.autograd.grad``,
a backward of one's own) they are returned to autograd like any node's. A single Linear takes autograd's own
``baddbmm`` (:func:`~.fused_network.batched_linear`): as a chain of one it measured no faster in the
acceptance pairs of benchmarks/pool.py (transformer block and MNIST-1D CNN, m = 8, b = 4 and 16). Why the
chains are kept: :mod:`.fused_chain`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..step_gradients import StepGradients, put_product, put_sum

_Forward = Callable[[torch.Tensor], torch.Tensor]
#: ``backward(grad, saved)`` where ``saved`` is the activation's input or output (see :class:`Kernels`).
_Backward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Kernels(NamedTuple):
    """An activation's forward and backward, and whether the backward reads its output (else its input)."""

    forward: _Forward
    backward: _Backward
    on_output: bool


def _gelu(layer: nn.GELU) -> Kernels:
    """GELU's kernels with the layer's approximation."""
    approximate = layer.approximate
    return Kernels(
        lambda x: F.gelu(x, approximate=approximate),
        lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate=approximate),
        False,
    )


def _leaky_relu(layer: nn.LeakyReLU) -> Kernels:
    """LeakyReLU's kernels with the layer's slope."""
    slope = layer.negative_slope
    return Kernels(
        lambda x: F.leaky_relu(x, slope),
        lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, slope, False),
        False,
    )


#: Exact activation type → its kernels for a layer of that type.
_KERNELS: dict[type[nn.Module], Callable[[Any], Kernels]] = {
    nn.ReLU: lambda _: Kernels(torch.relu, lambda g, y: torch.ops.aten.threshold_backward(g, y, 0), True),
    nn.Tanh: lambda _: Kernels(torch.tanh, torch.ops.aten.tanh_backward, True),
    nn.Sigmoid: lambda _: Kernels(torch.sigmoid, torch.ops.aten.sigmoid_backward, True),
    nn.SiLU: lambda _: Kernels(F.silu, torch.ops.aten.silu_backward, False),
    nn.GELU: _gelu,
    nn.LeakyReLU: _leaky_relu,
    nn.Identity: lambda _: Kernels(lambda x: x, lambda g, _: g, True),
}

#: The activation types :func:`activation_kernels` knows.
ACTIVATIONS = tuple(_KERNELS)


def activation_kernels(layer: nn.Module) -> Kernels | None:
    """The kernels of an activation layer that can join a chain (exact types only: a subclass may override
    ``forward``); None for any other layer, which ends a chain."""
    make = _KERNELS.get(type(layer))
    return make(layer) if make is not None else None


#: A chain's program: None for a Linear (its weight and bias are the next two weights), else an activation.
Steps = Sequence[Kernels | None]


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes a matmul in on ``x``'s device now, or None (autocast is off)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def chain_forward(
    steps: Steps, x: torch.Tensor, weights: Sequence[torch.Tensor | None], dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every step in turn on ``x`` ``(m, N, in)``: the output, and what the backward reads (each Linear's
    input, each activation's input or output, one per step). With ``dtype`` (mixed precision) the input and
    every weight are cast to it first, as autocast casts a matmul's operands; the backward follows the
    saved tensors' dtype."""
    saved: list[torch.Tensor] = []
    h, k = x if dtype is None else x.to(dtype), 0
    for step in steps:
        if step is None:
            weight, bias = weights[k], weights[k + 1]
            assert weight is not None
            if dtype is not None:
                weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
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
    return h, saved


def chain_backward(
    steps: Steps,
    grad: torch.Tensor,
    saved: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    wanted: Sequence[bool],
    input_grad: bool,
    into: Sequence[torch.Tensor | None] | None = None,
    add: bool = False,
    ready: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The steps backwards from ``grad`` (the output's): ``∂x = ∂y @ W``, ``∂W = ∂yᵀ @ x`` (the weight's
    layout), ``∂b = Σₙ ∂y``. Returns the input's gradient (None unless ``input_grad``) and each weight's
    (None where not ``wanted``). With ``into``, each weight's gradient is put into ``into[k]`` instead
    (added to it with ``add``, else overwriting it: :func:`~.step_gradients.put_product`) and ``ready(k)``
    is called as soon as it is there. The arithmetic runs in the saved tensors' dtype (16 bits under mixed
    precision)."""
    grads: list[torch.Tensor | None] = [None] * len(weights)
    k = len(weights)
    dtype = saved[0].dtype
    grad = grad.to(dtype)
    for i in range(len(steps) - 1, -1, -1):
        step, kept = steps[i], saved[i]
        if step is not None:
            grad = step.backward(grad, kept)
            continue
        k -= 2
        weight, bias = weights[k], weights[k + 1]
        assert weight is not None
        weight = weight.to(dtype)
        if into is None:
            if wanted[k]:
                grads[k] = torch.bmm(grad.transpose(1, 2), kept)
            if bias is not None and wanted[k + 1]:
                grads[k + 1] = grad.sum(1)
        else:
            put_product(into[k], grad.transpose(1, 2), kept, add)  # type: ignore[arg-type]
            if bias is not None:
                put_sum(into[k + 1], grad, add)  # type: ignore[arg-type]
        if ready is not None:
            ready(k)
            if bias is not None:
                ready(k + 1)
        if i == 0 and not input_grad:
            return None, grads
        grad = torch.bmm(grad, weight)
    return grad, grads


class _Chain(torch.autograd.Function):
    """Forward and backward of a chain, ``(m, N, in) → (m, N, out)``."""

    @staticmethod
    def forward(
        ctx: Any, steps: Steps, sink: StepGradients | None, x: torch.Tensor, *weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Every step in turn (in autocast's dtype when autocast is on); keeps each Linear's input and each
        activation's input or output."""
        h, saved = chain_forward(steps, x, weights, autocast_dtype(x))
        ctx.steps, ctx.sink, ctx.params = steps, sink, weights
        # Through save_for_backward, not attributes: the output may be among them (a reference cycle
        # otherwise), and autograd then checks that nothing was changed in place before the backward.
        ctx.save_for_backward(*saved, *weights)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The steps backwards (:func:`chain_backward`): the weights' gradients put into their ``.grad`` rows
        while the pool's backward runs (:mod:`.step_gradients`), else handed to autograd to accumulate."""
        steps, sink, params = ctx.steps, ctx.sink, ctx.params
        tensors = ctx.saved_tensors
        saved, weights = tensors[: len(steps)], tensors[len(steps) :]
        wanted = ctx.needs_input_grad[3:]
        into = None if sink is None else sink.rows_of(params)
        grad_x, grads = chain_backward(
            steps,
            grad,
            saved,
            weights,
            wanted,
            ctx.needs_input_grad[2],
            into,
            add=True if sink is None else sink.adds,
            ready=None if into is None else sink.announcer(params),
        )
        return (None, None, grad_x, *grads)


def batched_chain(
    steps: Steps, x: torch.Tensor, weights: Sequence[torch.Tensor | None], sink: StepGradients | None = None
) -> torch.Tensor:
    """The chain ``steps`` on ``x`` ``(m, N, in)`` with ``weights`` (each Linear's ``(m, out, in)`` weight and
    ``(m, out)`` bias or None, in order): ``(m, N, out)``, one autograd node. While the pool's backward runs
    (``sink`` open), its backward puts the weights' gradients straight into their ``.grad``
    (:mod:`.step_gradients`)."""
    return _Chain.apply(steps, sink, x, *weights)
