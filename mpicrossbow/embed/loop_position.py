"""LoopPosition: where the user's own loop stands — its epoch (``xb.epochs``), each training loader's epoch
and batch, the optimizer step — so that a replacement rank (``xb.init(elastic={"replace": True})``) running
the same script from its top goes on at the survivors' point.

A replacement executes the user's script as every rank did at start: ``xb.init``, the model, ``xb.shard``,
``xb.distribute``, the loop. Its collectives must meet the survivors' at the same step, so its loop starts
where theirs stands: ``for epoch in xb.epochs(1, epochs + 1)`` (``range``'s arguments) yields from the
survivors' epoch on, and each training loader of ``xb.shard`` (matched in the order the script made them)
reads that epoch from the batch after the survivors' last. A plain ``for epoch in range(...)`` cannot be
moved, so the survivors admit a replacement only inside an ``xb.epochs`` loop, and only while the epoch's
training loader has batches left (the epoch's end has collectives of the user's own, such as validation under
``xb.consensus``, that a replacement joining there would not make).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from .sharded_loader import ShardedLoader

#: What a replacement is told of the loop (rank 0's :meth:`LoopPosition.where`): the optimizer step, the
#: index of the epoch in ``xb.epochs``' range, each training loader's (epoch, next batch), the data's parts.
Position = dict[str, Any]


class LoopPosition:
    """The loop's position on this rank, and on a replacement the position it starts from."""

    def __init__(self) -> None:
        #: The index into ``xb.epochs``' range of the epoch under way (None: no ``xb.epochs`` loop runs).
        self.epoch_index: int | None = None
        #: The training loaders of ``xb.shard``, in the order the script made them.
        self.loaders: list[weakref.ref[ShardedLoader]] = []
        #: A replacement: the survivors' position, applied as the script reaches each part of it.
        self.joining: Position | None = None
        #: How many parts the training data was cut into at start (the part a replacement reads is its lost
        #: start rank's, of as many).
        self.parts = 1

    def add(self, loader: ShardedLoader) -> None:
        """A loader of ``xb.shard``; a training loader of a replacement starts at the survivors' batch."""
        if loader.evaluation:
            return
        if self.joining is not None and len(self.loaders) < len(self.joining["loaders"]):
            epoch, start = self.joining["loaders"][len(self.loaders)]
            loader.set_epoch(epoch, start)
        self.loaders.append(weakref.ref(loader))

    def epochs(self, bounds: tuple[int, ...]) -> Iterator[int]:
        """``range(*bounds)``'s epochs, from the survivors' one on a replacement (see the module doc)."""
        values = range(*bounds)
        first = 0
        if self.joining is not None:
            first, self.joining["epoch_index"] = self.joining["epoch_index"], 0  # a second loop starts at 0
        try:
            for index in range(first, len(values)):
                self.epoch_index = index
                yield values[index]
        finally:
            self.epoch_index = None

    def where(self, step: int) -> Position | None:
        """The position a replacement joining after this step starts from, or None where none can join:
        outside an ``xb.epochs`` loop, or at an epoch's last batch."""
        live = [loader for loader in (ref() for ref in self.loaders) if loader is not None]
        if self.epoch_index is None or not any(loader.mid_epoch for loader in live):
            return None
        loaders = [
            (loader.epoch - 1, loader.consumed) if loader.mid_epoch else (loader.epoch, 0) for loader in live
        ]
        return {"step": step, "epoch_index": self.epoch_index, "loaders": loaders, "parts": self.parts}
