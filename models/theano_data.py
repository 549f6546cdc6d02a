"""Theano-MPI's DataClass shape over any of this repository's sharded arrays: batches fetched by count.

A Theano-MPI model owns its data: ``data.n_batch_train`` and ``data.n_batch_val`` say how many batches an
epoch has, and ``train_iter(count, ...)`` / ``val_iter(count, ...)`` ask for batch ``count``. This adapter
serves those from a :class:`~mpicrossbow.model.shard.ShardedArrays` (digits, CIFAR-10, synthetic data),
reshuffling the training part whenever ``count`` starts again at 0.
"""

from __future__ import annotations

from typing import Any

import torch


class BatchesByCount:
    """``n_batch_train``, ``n_batch_val`` and batch ``count`` of the current epoch, from ``arrays``."""

    def __init__(self, arrays: Any) -> None:
        self.arrays = arrays
        self.n_batch_train = arrays.n_batch_train
        self.n_batch_val = arrays.n_batch_val
        self.epoch = -1
        self._train: list[Any] = []
        self._val = list(arrays.val_batches())

    def train_batch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``count`` of the current epoch (the next epoch's order when count wraps to 0)."""
        if count == 0:
            self.epoch += 1
            self._train = list(self.arrays.train_batches(self.epoch))
        return self._train[count]

    def val_batch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch ``count``."""
        return self._val[count]
