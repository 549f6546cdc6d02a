"""One learner's data through a ``torch.utils.data.DataLoader``: the DataClass the pools train from.

:class:`LoaderData` has the DataClass members of the model contract (``n_batch_train``, ``n_batch_val``,
``train_batches(epoch)``, ``val_batches()``) over any map-style data set: the learner's part comes from
:mod:`.sampler` (equal on every learner, reshuffled per epoch), decoding and augmentation run in
``workers`` processes that load ``prefetch`` batches ahead, batches are page-locked when they go to a GPU.
The training loader keeps its workers between epochs (persistent); validation starts its own each time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..errors import DataError
from ..model.shard import Shard
from .sampler import EpochBatches, InOrder, train_part, val_part
from .seeded import Seeded, collate, quiet_worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoaderOptions:
    """How a learner loads: worker processes, batches loaded ahead, pinned memory, the bad-sample policy."""

    workers: int = 0
    prefetch: int = 2
    pin_memory: bool = False
    on_bad_sample: str = "error"
    verify: bool = True


class Batches:
    """An epoch's batches as an iterator that starts its DataLoader pass only when first asked.

    ``skip(count)`` before that moves the start instead of loading ``count`` batches (resuming mid-epoch).
    """

    def __init__(self, loader: DataLoader, sampler: EpochBatches, epoch: int) -> None:
        self.loader, self.sampler, self.epoch = loader, sampler, epoch
        self.start = 0
        self._it: Iterator[Any] | None = None

    def skip(self, count: int) -> None:
        """Leave out the first ``count`` batches of the epoch without loading them."""
        if self._it is not None:
            for _ in range(count):
                next(self._it)
        else:
            self.start += count

    def __iter__(self) -> Batches:
        """Itself: one pass."""
        return self

    def __next__(self) -> Any:
        """The next ``(inputs, targets)``."""
        if self._it is None:
            self.sampler.set_epoch(self.epoch, self.start)
            self._it = iter(self.loader)
        return next(self._it)


class LoaderData:
    """A learner's training part and validation slice of the two data sets, batched by DataLoaders."""

    def __init__(self, train_set: Any, val_set: Any, shard: Shard, options: LoaderOptions) -> None:
        """Cut this learner's parts, check their files (``verify``) and build the two loaders."""
        self.shard, self.options = shard, options
        self.train_set, self.val_set = train_set, val_set
        self.source = str(getattr(train_set, "source", type(train_set).__name__))
        part = train_part(len(train_set), shard, bool(getattr(train_set, "pre_shuffled", False)))
        self.sampler = EpochBatches(part, shard.batch_size, shard.seed, shard.rank)
        self.n_batch_train = len(self.sampler)
        if self.n_batch_train == 0:
            raise DataError(
                f"{self.source}: a learner's part holds {len(part)} of {len(train_set)} training samples, "
                f"fewer than one batch of {shard.batch_size} ({shard.size} learner(s) share the data); "
                "use a smaller batch size or fewer ranks or learners"
            )
        self.val_sampler = InOrder(val_part(len(val_set), shard), shard.batch_size)
        self.n_batch_val = len(self.val_sampler)
        if options.verify:
            check_files(train_set, part, options.on_bad_sample)
            check_files(val_set, self.val_sampler.part, options.on_bad_sample)
        self.loader = self._loader(train_set, self.sampler, persistent=True)

    def _loader(self, dataset: Any, sampler: Any, persistent: bool) -> DataLoader:
        """A DataLoader over ``dataset`` indexed by ``(index, seed)`` batches from ``sampler``."""
        return seeded_loader(dataset, sampler, self.options, self.shard.seed, persistent)

    def train_batches(self, epoch: int) -> Batches:
        """Exactly ``n_batch_train`` full batches, in epoch ``epoch``'s order."""
        return Batches(self.loader, self.sampler, epoch)

    def val_batches(self) -> Iterator[Any]:
        """This learner's validation slice in order; the last batch may be short."""
        if not len(self.val_sampler.part):
            return iter(())
        return iter(self._loader(self.val_set, self.val_sampler, persistent=False))

    def close(self) -> None:
        """Stop the training loader's worker processes."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def seeded_loader(
    dataset: Any, sampler: Any, options: LoaderOptions, seed: int, persistent: bool
) -> DataLoader:
    """A DataLoader over ``dataset`` whose batches of ``(index, sample seed)`` come from ``sampler``.

    Workers, prefetching and pinning follow ``options``; the loader draws its workers' base seeds from its
    own generator seeded with ``seed``, never from the global one, so a run repeats whatever the model code
    draws. Shared by the pools' :class:`LoaderData` and the embedded API's ``xb.shard``.
    """
    workers = options.workers
    return DataLoader(
        Seeded(dataset),
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        prefetch_factor=options.prefetch if workers else None,
        persistent_workers=persistent and workers > 0,
        pin_memory=options.pin_memory,
        worker_init_fn=quiet_worker if workers else None,
        generator=torch.Generator().manual_seed(seed),
    )


def check_files(dataset: Any, indices: np.ndarray, on_bad_sample: str) -> None:
    """Before training: a data set with ``verify(indices)`` checks its files (headers) for this part.

    A bad file is a DataError naming it (``on_bad_sample = error``), or a warning naming the files it will
    skip (``skip``: the data set replaces each by the next readable sample when loading).
    """
    verify = getattr(dataset, "verify", None)
    if not callable(verify) or not len(indices):
        return
    bad = verify(indices.tolist())
    if not bad:
        return
    source = getattr(dataset, "source", type(dataset).__name__)
    if on_bad_sample == "error":
        _, reason = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise DataError(f"{reason}{more}; fix or remove it, or set [data] on_bad_sample = skip")
    names = ", ".join(reason for _, reason in bad[:5])
    log.warning(
        "%s: skipping %d unreadable sample(s): %s%s", source, len(bad), names, " ..." * (len(bad) > 5)
    )


def pin_memory_for(setting: str, device: torch.device) -> bool:
    """``[data] pin_memory``: auto means on exactly when batches go to a CUDA device."""
    return device.type == "cuda" if setting == "auto" else setting == "true"
