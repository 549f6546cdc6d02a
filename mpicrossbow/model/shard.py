"""A rank's share of a data set, and the batches the framework trains from.

Every rank holds only its own rows. Training shards are *equal in size* on every rank: synchronous exchange
rules need every learner to take the same number of steps per epoch, or the collectives hang. Validation
shards cover the whole validation set exactly once over the ranks, so an allreduced accuracy is exact.

Readers (``data/*.py``) pick rows with :func:`train_indices` / :func:`val_indices`, read only those rows and
hand the arrays to :class:`ShardedArrays`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from mpicrossbow.errors import DataError

logger = logging.getLogger(__name__)

#: Anything ShardedArrays accepts as an array.
ArrayLike = np.ndarray | torch.Tensor


@dataclass(frozen=True)
class Shard:
    """Which part of the data this learner holds: ``rank`` of ``size``, and its per-learner batch size.

    ``seed`` is the session seed; it drives the per-epoch reshuffle, never which rows a rank holds.
    ``span`` (``(start, end)`` fractions, 0 ≤ start < end ≤ 1) replaces the equal share by that part of the
    training set (GSP's data-sharding file gives fast workers more rows); validation shards ignore it.
    """

    rank: int
    size: int
    batch_size: int
    seed: int = 0
    span: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        """Reject impossible shards early, before any file is read."""
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"Shard needs 0 <= rank < size, got rank={self.rank} size={self.size}")
        if self.batch_size < 1:
            raise ValueError(f"Shard needs batch_size >= 1, got {self.batch_size}")
        if self.seed < 0:
            raise ValueError(f"Shard needs seed >= 0, got {self.seed}")
        if self.span is not None and not 0.0 <= self.span[0] < self.span[1] <= 1.0:
            raise ValueError(f"Shard needs a span 0 <= start < end <= 1, got {self.span}")


def train_indices(n_total: int, shard: Shard, split_seed: int) -> np.ndarray:
    """Sorted rows of a training set of ``n_total`` samples that ``shard`` holds.

    A permutation seeded by ``split_seed`` (the same on every rank) is dealt round-robin and cut to
    ``n_total // size`` rows, so every rank holds the same number of distinct rows; at most ``size - 1``
    samples are left out. Sorted, because HDF5 fancy indexing and memmap reads want increasing rows.
    With a ``span`` the shard is instead rows ``[⌊start·n⌋, ⌊end·n⌋)`` of the same permutation, so spans
    that tile [0, 1] give every row to exactly one shard.
    """
    perm = np.random.default_rng(split_seed).permutation(n_total)
    if shard.span is not None:
        start, end = (math.floor(f * n_total + 1e-9) for f in shard.span)
        return np.sort(perm[start:end])
    return np.sort(perm[shard.rank :: shard.size][: n_total // shard.size])


def val_indices(n_total: int, shard: Shard) -> np.ndarray:
    """Contiguous, near-equal slice of ``range(n_total)`` for ``shard``; the slices cover every row once."""
    return np.array_split(np.arange(n_total), shard.size)[shard.rank]


def _as_tensor(array: ArrayLike, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` holding ``array`` (copies only when needed)."""
    tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(dtype).contiguous()


class ShardedArrays:
    """The data class the framework trains from, built from this rank's already-loaded arrays.

    ``x`` arrays become float32 tensors ``(N, ...)``, ``y`` arrays int64 ``(N,)``. ``n_batch_train`` is
    ``n_train // batch_size``; it is identical on every rank when the training arrays come from
    :func:`train_indices`. ``source`` names the data (a file or folder) in error messages.
    """

    def __init__(
        self,
        x_train: ArrayLike,
        y_train: ArrayLike,
        x_val: ArrayLike,
        y_val: ArrayLike,
        shard: Shard,
        *,
        source: str = "data set",
    ) -> None:
        """Check the shapes, convert to tensors and count the batches."""
        self.shard = shard
        self.x_train = _as_tensor(x_train, torch.float32)
        self.y_train = _as_tensor(y_train, torch.int64)
        self.x_val = _as_tensor(x_val, torch.float32)
        self.y_val = _as_tensor(y_val, torch.int64)
        for part, x, y in (("train", self.x_train, self.y_train), ("val", self.x_val, self.y_val)):
            if y.ndim != 1 or x.ndim < 1 or len(x) != len(y):
                raise DataError(
                    f"{source}: {part} x has shape {tuple(x.shape)} but y has shape {tuple(y.shape)}; "
                    "expected (N, ...) and (N,)"
                )
        self.n_train = len(self.y_train)
        self.n_val = len(self.y_val)
        if self.n_train < shard.batch_size:
            raise DataError(
                f"{source}: each of {shard.size} rank(s) holds {self.n_train} training samples, fewer than "
                f"one batch of {shard.batch_size}; use a smaller batch size or fewer ranks"
            )
        self.n_batch_train = self.n_train // shard.batch_size
        self.n_batch_val = -(-self.n_val // shard.batch_size)
        logger.debug(
            "%s: rank %d holds %d train (%d batches) and %d val samples",
            source,
            shard.rank,
            self.n_train,
            self.n_batch_train,
            self.n_val,
        )

    def epoch_generator(self, epoch: int) -> torch.Generator:
        """The generator that shuffles ``epoch``: seeded from (seed, rank, epoch), so runs are repeatable."""
        state = np.random.SeedSequence([self.shard.seed, self.shard.rank, epoch]).generate_state(1)
        return torch.Generator().manual_seed(int(state[0]))

    def train_batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Exactly ``n_batch_train`` full batches of ``batch_size``, in a fresh order each epoch."""
        order = torch.randperm(self.n_train, generator=self.epoch_generator(epoch))
        size = self.shard.batch_size
        for b in range(self.n_batch_train):
            rows = order[b * size : (b + 1) * size]
            yield self.x_train[rows], self.y_train[rows]

    def val_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's whole validation shard in order; the last batch may be short, none if it is empty."""
        size = self.shard.batch_size
        for start in range(0, self.n_val, size):
            yield self.x_val[start : start + size], self.y_val[start : start + size]
