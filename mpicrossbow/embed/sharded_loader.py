"""ShardedLoader: ``xb.shard``'s DataLoader — this rank's equal share of a data set, a new order every epoch.

It is the pipeline ``crossbow-launch`` trains from (:mod:`mpicrossbow.data.sampler`), so the same data set,
batch size and seed give the same batches in the same order under both: the indices are put in a fixed
order and cut into one equal part per training rank (every rank takes the same number of steps, which
synchronous rules need), each epoch reshuffles the part with a generator seeded from (seed, part, epoch),
and every sample gets its own seed for augmentation. Iterating the loader starts the next epoch by itself:
no ``set_epoch`` to forget (call :meth:`ShardedLoader.set_epoch` to resume at a given one).

``evaluation=True`` makes an evaluation loader instead (Horovod's ``DistributedSampler`` on a test set,
without its padding): the ranks' parts are near-equal contiguous slices that together hold every sample
once, in order, the last batch short where the part is not a multiple of the batch; nothing is dropped,
shares may differ by one sample, and a part smaller than a batch is fine. :attr:`ShardedLoader.samples` is
the rank's own sample count, what a mean over ranks is weighted by. A training loader keeps full batches
only: its last partial batch is left out (a different one every epoch), so every rank takes the same number
of steps, which synchronous rules need; ``samples`` counts what it iterates.

Which part a rank reads is the rule's to say — a parameter server's ranks read none, GSP's shares file
gives fast ranks more — so the part is cut when the loader is first used (``len`` or iteration), after
``xb.distribute`` named the rule. Used before, it cuts ``rank`` of ``size`` and ``xb.distribute`` refuses a
rule that wants another cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.loader import LoaderOptions, seeded_loader
from ..data.sampler import EpochBatches, InOrder, train_part, val_part
from ..errors import DataError, UsageError
from ..model.shard import Shard


@dataclass(frozen=True)
class Part:
    """Which share of the training set a rank reads: part ``index`` of ``count`` (or the fraction
    ``span``), or nothing on a rank that does not train."""

    index: int
    count: int
    span: tuple[float, float] | None = None
    trains: bool = True


class ShardedLoader:
    """Batches of ``(inputs, targets)`` of this rank's part of ``dataset`` (see the module doc)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        seed: int,
        part_of: Callable[[], Part],
        options: LoaderOptions,
        evaluation: bool = False,
        size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise UsageError(f"xb.shard: batch_size must be at least 1, got {batch_size}")
        if seed < 0:
            raise UsageError(f"xb.shard: seed must be 0 or more, got {seed}")
        try:
            self.total = len(dataset)
        except TypeError:
            raise UsageError(
                f"xb.shard needs a map-style data set (with __len__ and __getitem__), got "
                f"{type(dataset).__name__}"
            ) from None
        #: The whole data set, as ``DataLoader.dataset`` (scripts log ``len(loader.dataset)``).
        self.dataset = dataset
        #: Every sample once, in order, shares near-equal (True); or full shuffled batches (training).
        self.evaluation = evaluation
        if not evaluation and self.total // max(size, 1) < batch_size:
            raise DataError(  # checked when built: the equal share is the smallest a rule cuts
                f"xb.shard: {self.total} samples over {size} rank(s) leave each fewer than one batch of "
                f"{batch_size}; use a smaller batch size or fewer ranks, or xb.shard(..., evaluation=True) "
                "for an evaluation set (every sample, uneven shares)"
            )
        self.batch_size, self.seed, self.options = batch_size, seed, options
        self._part_of = part_of
        #: The epoch the next iteration reads, and the batch it starts from (a replacement joining mid-epoch).
        self.epoch, self.start = 0, 0
        #: Batches of the current epoch behind the last one yielded (those skipped by ``start`` too): where
        #: a replacement joining after this step starts reading.
        self.consumed = 0
        self.part: Part | None = None
        self._sampler: EpochBatches | None = None
        self._loader: Any = None

    def _cut(self) -> EpochBatches | InOrder:
        """The sampler of this rank's part, cut on first use."""
        if self._sampler is not None:
            return self._sampler
        part = self.part = self._part_of()
        if self.evaluation:
            indices = val_part(self.total, Shard(part.index, part.count, self.batch_size, self.seed))
            evaluation = InOrder(indices if part.trains else np.arange(0), self.batch_size)
            self._sampler = evaluation
            self._loader = seeded_loader(self.dataset, evaluation, self.options, self.seed, persistent=True)
            return evaluation
        if not part.trains:
            indices = np.arange(0)
        else:
            shard = Shard(part.index, part.count, self.batch_size, self.seed, span=part.span)
            indices = train_part(self.total, shard, bool(getattr(self.dataset, "pre_shuffled", False)))
        sampler = EpochBatches(indices, self.batch_size, self.seed, part.index)
        if part.trains and not len(sampler):
            raise DataError(
                f"xb.shard: this rank's part holds {len(indices)} of {self.total} samples, fewer than one "
                f"batch of {self.batch_size} ({part.count} rank(s) share the data); use a smaller batch "
                "size or fewer ranks"
            )
        self._sampler = sampler
        self._loader = seeded_loader(self.dataset, sampler, self.options, self.seed, persistent=True)
        return sampler

    def check_part(self, wanted: Part) -> None:
        """``xb.distribute``: refuse a rule that wants another part than the one already cut."""
        if self.part is not None and self.part != wanted:
            raise UsageError(
                "a loader from xb.shard was used (len() or a loop) before xb.distribute, and the rule reads "
                f"another part of the data ({wanted} instead of {self.part}): call xb.distribute first"
            )

    def __len__(self) -> int:
        """Batches per epoch (training: full batches only, the same on every training rank; evaluation: the
        last one possibly short; 0 on a serving rank)."""
        return len(self._cut())

    @property
    def samples(self) -> int:
        """This rank's own samples per epoch: what one pass yields (a training loader's full batches; an
        evaluation loader's whole share). Weigh a per-rank mean by it (``len(loader.dataset)`` is the whole
        data set's size)."""
        sampler = self._cut()
        if isinstance(sampler, InOrder):
            return len(sampler.part)
        return len(sampler) * self.batch_size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Make the next iteration read epoch ``epoch`` (resuming) from its batch ``start`` (a training
        loader: the batches before it are skipped without loading); iterations go on from there."""
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[Any]:
        """One epoch: this rank's part in the epoch's order; the next iteration is the next epoch."""
        sampler = self._cut()
        start, self.start = (self.start, 0) if isinstance(sampler, EpochBatches) else (0, 0)
        if isinstance(sampler, EpochBatches):
            sampler.set_epoch(self.epoch, start)
        self.epoch += 1
        self.consumed = start
        return self._counted(iter(self._loader))

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, counting each into :attr:`consumed` as it is handed out."""
        for batch in batches:
            self.consumed += 1
            yield batch

    @property
    def mid_epoch(self) -> bool:
        """Whether an iteration is under way with batches left in it (a training loader)."""
        return 0 < self.consumed < len(self) and not self.evaluation

    def close(self) -> None:
        """Stop the loader's worker processes (``workers > 0``)."""
        iterator = getattr(self._loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
