"""Deterministic random data for benchmarks: any shape, any number of classes, no file to read."""

from __future__ import annotations

import logging

import numpy as np

from mpicrossbow.model.shard import Shard, ShardedArrays, train_indices, val_indices

logger = logging.getLogger(__name__)


class Synthetic(ShardedArrays):
    """A learnable random data set: each sample is its class's fixed random pattern plus unit noise.

    The whole set is generated from ``seed``, so it is the same on every rank and every run; each rank then
    keeps its share (:func:`train_indices` / :func:`val_indices`). Benchmarks measure speed, but a loss that
    can fall still shows that training works.
    """

    def __init__(
        self,
        shard: Shard,
        shape: tuple[int, ...] = (3, 32, 32),
        classes: int = 10,
        n_train: int = 1024,
        n_val: int = 256,
        seed: int = 0,
    ) -> None:
        """Generate the data set and keep this rank's rows."""
        if classes < 1 or n_train < 0 or n_val < 0 or any(d < 1 for d in shape):
            raise ValueError(
                f"Synthetic needs classes >= 1, n >= 0 and a positive shape; got {classes}, "
                f"{n_train}, {n_val}, {shape}"
            )
        rng = np.random.default_rng(seed)
        patterns = rng.standard_normal((classes, *shape), dtype=np.float32)
        y = rng.integers(0, classes, n_train + n_val)
        x = patterns[y] + rng.standard_normal((n_train + n_val, *shape), dtype=np.float32)
        train, val = train_indices(n_train, shard, seed), n_train + val_indices(n_val, shard)
        super().__init__(
            x[train], y[train], x[val], y[val], shard, source=f"synthetic {shape} x {classes} classes"
        )
