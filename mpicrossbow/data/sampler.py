"""Which samples a learner reads, and in what order, epoch after epoch (the DataLoader pipeline's sampler).

Who reads what: learner j of rank r is part ``r·m + j`` of ``size·m`` (a
:class:`~mpicrossbow.model.shard.Shard`).
The data set's indices are put in a fixed order — a permutation seeded by a constant, so the parts never
depend on the session seed, or the identity for a data set that is already shuffled on disk
(``pre_shuffled``: packed shards, so a learner's part is a run of consecutive shard files and it opens only
those) — and cut into ``size·m`` contiguous parts of ``n // (size·m)`` samples: every learner takes the same
number of steps, which synchronous rules need. GSP's ``span`` gives a learner that fraction of the order
instead. When: every epoch, the part is reshuffled by a generator seeded from (seed, learner, epoch), and
every sample gets its own seed from (seed, epoch, index) for its augmentation, so a run repeats exactly,
whatever the worker count, and a resumed run continues where the interrupted one was.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..model.shard import Shard

#: Seed of the fixed order the parts are cut from (independent of the session seed, like a split seed).
PARTITION_SEED = 0
#: The 'epoch' validation samples are seeded with (validation transforms should not draw anyway).
VAL_EPOCH = 1 << 30
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def train_part(n_total: int, shard: Shard, pre_shuffled: bool = False) -> np.ndarray:
    """The indices of the training set that ``shard`` reads, in the fixed order (see the module doc)."""
    order = np.arange(n_total) if pre_shuffled else np.random.default_rng(PARTITION_SEED).permutation(n_total)
    if shard.span is not None:
        start, end = (math.floor(f * n_total + 1e-9) for f in shard.span)
        return order[start:end]
    per = n_total // shard.size
    return order[shard.rank * per : (shard.rank + 1) * per]


def val_part(n_total: int, shard: Shard) -> np.ndarray:
    """Contiguous, near-equal slice of the validation set; the slices of all learners cover it once."""
    return np.array_split(np.arange(n_total), shard.size)[shard.rank]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, vectorised: well-mixed 64-bit seeds from nearby integers."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def sample_seeds(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """One seed per sample from (seed, epoch, index): the same sample in the same epoch always draws alike."""
    base = _splitmix64(np.array([seed * 1_000_003 + epoch], dtype=np.uint64))
    return (_splitmix64(base ^ indices.astype(np.uint64)) >> np.uint64(1)).astype(np.int64)


class EpochBatches:
    """The batch sampler: full batches of ``(index, sample_seed)`` of one learner's part for one epoch.

    ``set_epoch(epoch, start)`` picks the epoch and the first batch (resuming mid-epoch skips without
    loading); the DataLoader re-reads it each time it is iterated, also with persistent workers.
    """

    def __init__(self, part: np.ndarray, batch_size: int, seed: int, learner: int) -> None:
        self.part, self.batch_size, self.seed, self.learner = part, batch_size, seed, learner
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        """Full batches per epoch (the rest of the part is left out, differently every epoch)."""
        return len(self.part) // self.batch_size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Make the next iteration epoch ``epoch``'s order, from batch ``start``."""
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> np.ndarray:
        """The part in epoch ``epoch``'s order."""
        state = np.random.SeedSequence([self.seed, self.learner, epoch]).generate_state(2)
        return self.part[np.random.default_rng(state).permutation(len(self.part))]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        """Batches ``start`` .. ``len(self) - 1`` of the current epoch."""
        order = self.order(self.epoch)[: len(self) * self.batch_size]
        seeds = sample_seeds(self.seed, self.epoch, order)
        size = self.batch_size
        for b in range(self.start, len(self)):
            rows = slice(b * size, (b + 1) * size)
            yield list(zip(order[rows].tolist(), seeds[rows].tolist(), strict=True))


class InOrder:
    """The validation batch sampler: the part in order, the last batch possibly short, fixed sample seeds."""

    def __init__(self, part: np.ndarray, batch_size: int) -> None:
        self.part, self.batch_size = part, batch_size

    def __len__(self) -> int:
        """Batches, the last one possibly short."""
        return -(-len(self.part) // self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        """Every sample of the part once, in order."""
        seeds = sample_seeds(0, VAL_EPOCH, self.part)
        for start in range(0, len(self.part), self.batch_size):
            rows = slice(start, start + self.batch_size)
            yield list(zip(self.part[rows].tolist(), seeds[rows].tolist(), strict=True))
