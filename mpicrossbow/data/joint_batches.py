"""One fetch for all of a rank's learners: the fused engine's batches without m DataLoader passes.

The fused engine stacks its m learners' batches into one ``(m, b, …)`` tensor. Loading them through m
DataLoaders costs m passes of the loader's machinery and a stack; with ``[data] workers = 0`` (loading in
the rank) the same samples — each learner's own part, order and per-sample seeds, from its own
:class:`~mpicrossbow.data.sampler.EpochBatches` — are read here as one list of m·b samples, collated once,
and viewed as ``(m, b, …)``: the very batches the m loaders would give, in one pass (measured: the fetch of
8 learners' batches of 4 took 2.3× that of one batch of 32 through DataLoaders; benchmarks/results/pool.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .loader import LoaderData
from .seeded import Seeded, collate


class JointBatches:
    """One epoch of every learner's batches, each step one fetch of m·b samples viewed as ``(m, b, …)``."""

    def __init__(self, datas: Sequence[LoaderData], epoch: int) -> None:
        self.samplers = [data.sampler for data in datas]
        self.dataset = Seeded(datas[0].train_set)
        self.epoch, self.start = epoch, 0
        self._iters: list[Any] | None = None

    @staticmethod
    def serves(datas: Sequence[Any]) -> bool:
        """Whether the learners can be fetched jointly: loaders over one data set, loading in the rank."""
        return (
            bool(datas)
            and all(type(data) is LoaderData for data in datas)
            and all(data.train_set is datas[0].train_set for data in datas)
            and all(data.options.workers == 0 and not data.options.pin_memory for data in datas)
        )

    def skip(self, count: int) -> None:
        """Leave out the first ``count`` batches of the epoch (resuming mid-epoch) without loading them."""
        if self._iters is None:
            self.start += count
            return
        for _ in range(count):
            for it in self._iters:
                next(it)

    def __iter__(self) -> JointBatches:
        """Itself: one pass."""
        return self

    def __next__(self) -> Any:
        """Every learner's next batch: ``(inputs, targets)`` of shape ``(m, b, …)``."""
        if self._iters is None:
            for sampler in self.samplers:
                sampler.set_epoch(self.epoch, self.start)
            self._iters = [iter(sampler) for sampler in self.samplers]
        keys = [key for it in self._iters for key in next(it)]
        m = len(self._iters)
        return tuple(t.view(m, -1, *t.shape[1:]) for t in collate(self.dataset.__getitems__(keys)))
