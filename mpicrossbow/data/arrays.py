"""A data set held in memory as two arrays: the form the small built-in data sets take in the pipeline."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError


class ArrayDataset(Dataset):
    """Samples ``(x[i], y[i])`` of float32 inputs ``(N, ...)`` and int64 labels ``(N,)``; ``targets`` is y.

    ``source`` names the file or folder in error messages. Small data sets (digits, MNIST, CIFAR-10) load
    whole: a worker process shares the arrays with its rank (fork), nothing is copied per sample.
    """

    #: Reading a sample draws no random numbers: the pipeline need not seed per sample.
    draws_random = False

    def __init__(self, x: Any, y: Any, source: str, classes: list[str] | None = None) -> None:
        """Convert and check the arrays."""
        self.x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        self.targets = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
        if self.targets.ndim != 1 or len(self.x) != len(self.targets):
            raise DataError(
                f"{source}: x has shape {tuple(self.x.shape)} but y has shape {tuple(self.targets.shape)}; "
                "expected (N, ...) and (N,)"
            )
        self.source = source
        self.classes = (
            classes if classes is not None else [str(c) for c in range(int(self.targets.max()) + 1)]
        )

    def __len__(self) -> int:
        """Number of samples."""
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index``: its input tensor and its label."""
        return self.x[index], self.targets[index]

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``indices``, one indexing each: what the DataLoader would stack sample by sample."""
        return self.x[indices], self.targets[indices]
