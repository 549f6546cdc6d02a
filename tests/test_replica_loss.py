"""Every replica's cross-entropy and its gradient without autograd (mpicrossbow/pool/fused/replica_loss.py).

A step by hand stands in for the fused engine's autograd step, so its losses and the logits' gradient must
be those of autograd through ``F.cross_entropy``, to the bit, ignored targets included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpicrossbow.pool.fused.replica_loss import IGNORE_INDEX, cross_entropy_and_grad


def logits_and_targets(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Three replicas' logits for 5 samples of 4 classes, and their targets, two of them ignored."""
    gen = torch.Generator().manual_seed(0)
    output = torch.randn(3, 5, 4, generator=gen, dtype=dtype) * 3
    targets = torch.randint(0, 4, (3, 5), generator=gen)
    targets[0, 2] = targets[2, 4] = IGNORE_INDEX
    return output, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_losses_and_gradient_equal_plain_cross_entropy(dtype: torch.dtype) -> None:
    output, targets = logits_and_targets(dtype)
    plain = output.clone().requires_grad_()
    flat = F.cross_entropy(plain.reshape(-1, 4), targets.reshape(-1), reduction="none")
    expected = flat.view(3, -1).mean(1)
    expected.sum().backward()  # what the pool backpropagates

    losses, grad = cross_entropy_and_grad(output, targets)
    assert torch.equal(losses, expected)
    assert torch.equal(grad, plain.grad)
    assert grad[0, 2].abs().sum() == 0, "an ignored target got a gradient"


def test_a_replica_mean_is_over_its_own_samples() -> None:
    output, targets = logits_and_targets(torch.float64)
    losses, _ = cross_entropy_and_grad(output, targets)
    for j in range(3):
        kept = targets[j] != IGNORE_INDEX
        own = F.cross_entropy(output[j][kept], targets[j][kept], reduction="sum") / targets.shape[1]
        torch.testing.assert_close(losses[j], own, rtol=1e-12, atol=0)
