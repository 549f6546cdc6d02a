"""A small transformer encoder block for token classification: embedding, multi-head self-attention,
LayerNorm, a GELU feed-forward, residual connections written in ``forward()``, a linear head on the mean.

A plain ``nn.Module`` (no layer of the project's own): the fused engine's test and benchmark model for
networks the layer-by-layer fuser does not know (they run through ``torch.func.vmap``).
"""

from __future__ import annotations

import torch
from torch import nn


class TransformerBlock(nn.Module):
    """``(N, length)`` token ids in, ``(N, num_classes)`` scores out."""

    def __init__(self, vocab: int = 32, width: int = 16, heads: int = 2, num_classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Attention and feed-forward, each with its residual and LayerNorm, then the mean token's scores."""
        h = self.embed(tokens)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = self.norm1(h + a)
        h = self.norm2(h + self.ff(h))
        return self.head(h.mean(dim=1))


class Tokens(torch.utils.data.Dataset):
    """Random token sequences and labels (a benchmark and test data set): ``factory(split)`` form too."""

    def __init__(self, n: int, length: int = 12, vocab: int = 32, classes: int = 4, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
        self.x = torch.randint(0, vocab, (n, length), generator=gen)
        self.targets = torch.randint(0, classes, (n,), generator=gen)

    #: Reading a sample draws nothing: the pipeline need not seed it.
    draws_random = False

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``i`` and its label."""
        return self.x[i], self.targets[i]

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences ``indices`` and their labels, one indexing each (the pipeline's whole-batch read)."""
        return self.x[indices], self.targets[indices]


def tokens(split: str, n: int = 2048, length: int = 12) -> Tokens:
    """``[data] dataset = models.transformer:tokens``: random sequences, ``n`` for train, n/4 for val."""
    return Tokens(n if split == "train" else n // 4, length, seed=0 if split == "train" else 1)
