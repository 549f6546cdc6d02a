"""A training step of a fused network that is one chain, differentiated by hand instead of by autograd.

A fused MLP is ``Flatten`` and then one :class:`~.fused_chain.FusedChain` (Linear, activation, …, Linear).
When its loss is the default cross-entropy, the whole step's derivative is known in closed form, so the
step runs without the autograd engine: the chain's forward with gradients off (it keeps what the backward
reads), the loss's gradient by the kernels autograd itself would call (:mod:`.replica_loss`), and the
chain's backward (:func:`~.batched_chain.chain_backward`) writing each weight's gradient straight into its
``.grad`` view of the pool's gradient rows.

**Needed for speed**: for a small network the step is mostly what surrounds the kernels (the graph's
construction, the loss's nodes, the engine's start, zeroing the rows). Without it the MLP's fused ÷ bound
(benchmarks/pool.py, m = 8, one thread, side by side) falls from 0.97 to 0.67 at b = 4 and from 0.86–0.94
to 0.60–0.64 at b = 16. Not measured on a GPU, where the same host work per step bounds a small network's
step (kernels are launched asynchronously, so the host's Python and autograd decide its pace).

The arithmetic is the autograd path's, kernel for kernel, so the gradients are the same; two differences in
behaviour, both under the pool's :class:`~.step_gradients.StepGradients` (the gradient contract): the
gradients are *written*, not added (the pool starts such a step with ``start(written=True)``, which does not
zero the rows); and no autograd hook fires, so the step tells the pool's gradient watchers as each weight's
gradient is complete, last layer first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..step_gradients import StepGradients, grad_rows
from .batched_chain import chain_backward, chain_forward
from .fused_chain import FusedChain
from .fused_network import FusedFlatten, FusedNetwork
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
        """The step for ``network`` when it is a :class:`~.fused_network.FusedNetwork` whose body is only
        flattening and then one chain of weights used once each, else None (the network trains through
        autograd, which sums a shared weight's gradients where this step would write one use's)."""
        if not isinstance(network, FusedNetwork) or not isinstance(network.body, nn.Sequential):
            return None
        *prefix, last = network.body
        if not isinstance(last, FusedChain) or not all(isinstance(p, FusedFlatten) for p in prefix):
            return None
        used = [id(w) for w in last.weights if w is not None]
        return ChainStep(prefix, last) if len(used) == len(set(used)) else None

    def serves(self, targets: torch.Tensor) -> bool:
        """Whether this step can take ``targets`` (class indices; class probabilities go through autograd)."""
        return targets.dtype == torch.long

    def __call__(
        self, inputs: torch.Tensor, targets: torch.Tensor, gradients: StepGradients
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every replica's step on ``inputs`` ``(m, N, …)`` and ``targets`` ``(m, N)``: its gradients put
        into the weights' ``.grad`` as ``gradients`` says (written, after ``start(written=True)``), each
        weight's watchers told as soon as it is there; returns each replica's mean loss ``(m,)`` and the
        output ``(m, N, C)``.

        The chain computes in the precision's autocast dtype (the loss in fp32, as autocast computes it), and
        the loss's gradient starts at ``gradients.scale`` instead of 1: every gradient below it carries the
        factor, as autograd's would."""
        with torch.no_grad():
            h = inputs
            for layer in self.prefix:
                h = layer(h)
            output, saved = chain_forward(self.chain.steps, h, self.weights, gradients.precision.dtype)
            losses, grad = cross_entropy_and_grad(output.float(), targets, gradients.scale)
            chain_backward(
                self.chain.steps,
                grad,
                saved,
                self.weights,
                self._wanted,
                False,
                grad_rows(self.weights),
                add=gradients.adds,
                ready=gradients.announcer(self.weights),
            )
        return losses, output
