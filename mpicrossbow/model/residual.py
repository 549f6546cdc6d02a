"""A residual connection as a module of its own, so networks that add a skip path stay fusable.

A ResNet block written as a custom ``forward`` is opaque to the fused engine (it cannot know what the method
computes). Written as ``Residual(body, shortcut)`` the block is data, not code: the engine fuses ``body`` and
``shortcut`` like any other layers and adds their outputs (:mod:`mpicrossbow.pool.fused.fused_network`).
"""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Module):
    """``body(x) + shortcut(x)``; ``shortcut`` defaults to the identity (He et al. 2016's skip connection)."""

    def __init__(self, body: nn.Module, shortcut: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = shortcut if shortcut is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of the two paths."""
        return self.body(x) + self.shortcut(x)
