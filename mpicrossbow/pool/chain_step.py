"""A training step of a fused network that is one chain, differentiated by hand instead of by autograd.

A fused MLP is ``Flatten`` and then one :class:`~.fused_chain.FusedChain` (Linear, activation, …, Linear).
When its loss is the default cross-entropy, the whole step's derivative is known in closed form, so the
step runs without the autograd engine: the chain's forward with gradients off (it keeps what the backward
reads), the loss's gradient by the kernels autograd itself would call (:mod:`.replica_loss`), and the
chain's backward (:func:`~.batched_chain.chain_backward`) writing each weight's gradient straight into its
``.grad`` view of the pool's gradient rows.

Why: for a small network the step is mostly what surrounds the kernels. Through autograd a fused MLP step
pays for the graph's construction, the loss's nodes, the engine's start and an accumulation of every
gradient into the zeroed rows (read, add, write 0.8 MB for 8 replicas of a 26 k-parameter MLP) — measured
at m = 8, batch 4, one thread: 462 µs a step against 296 µs this way, where the bound (one replica at
batch 32) takes 323 µs.

The arithmetic is the autograd path's, kernel for kernel, so the gradients are the same; two differences in
behaviour, both handled by the pool: the gradients are *written*, not added, so the pool does not zero the
rows before such a step; and no autograd hook fires, so the pool's :class:`~.grad_sink.GradSink` tells its
gradient watchers as each weight's gradient is complete, last layer first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .batched_chain import chain_backward, chain_forward, grad_rows
from .fuse import FusedFlatten, FusedNetwork
from .fused_chain import FusedChain
from .precision import FP32, Precision
from .replica_loss import cross_entropy_and_grad


class ChainStep:
    """Forward, default cross-entropy loss and backward of a one-chain fused network, without autograd."""

    def __init__(self, prefix: Sequence[nn.Module], chain: FusedChain) -> None:
        self.prefix = list(prefix)
        self.chain = chain
        self.weights = chain.weights
        self._wanted = [w is not None for w in self.weights]

    @staticmethod
    def of(network: nn.Module) -> ChainStep | None:
        """The step for ``network`` when it is a :class:`~.fuse.FusedNetwork` whose body is only flattening
        and then one chain, else None (the network trains through autograd)."""
        if not isinstance(network, FusedNetwork) or not isinstance(network.body, nn.Sequential):
            return None
        *prefix, last = network.body
        if not isinstance(last, FusedChain) or not all(isinstance(p, FusedFlatten) for p in prefix):
            return None
        return ChainStep(prefix, last)

    def serves(self, targets: torch.Tensor) -> bool:
        """Whether this step can take ``targets`` (class indices; class probabilities go through autograd)."""
        return targets.dtype == torch.long

    def __call__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        written: Callable[[torch.Tensor], None] | None = None,
        precision: Precision = FP32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every replica's step on ``inputs`` ``(m, N, …)`` and ``targets`` ``(m, N)``: its gradients written
        into the weights' ``.grad``; returns each replica's mean loss ``(m,)`` and the output ``(m, N, C)``.
        ``written(weight)`` is called as soon as a weight's gradient is there (a :class:`~.grad_sink.GradSink`
        telling the pool's watchers).

        ``precision``: the chain computes in its autocast dtype (the loss in fp32, as autocast computes it),
        and the loss's gradient starts at its loss scale instead of 1 — the one place a step by hand takes
        the scale; every gradient below it carries the factor, as autograd's would."""
        with torch.no_grad():
            h = inputs
            for layer in self.prefix:
                h = layer(h)
            output, saved = chain_forward(self.chain.steps, h, self.weights, precision.dtype)
            losses, grad = cross_entropy_and_grad(output.float(), targets, precision.scale)
            into = grad_rows(self.weights)
            chain_backward(
                self.chain.steps,
                grad,
                saved,
                self.weights,
                self._wanted,
                False,
                into,
                ready=None if written is None else lambda k: written(self.weights[k]),
            )
        return losses, output
