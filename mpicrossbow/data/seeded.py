"""A data set whose every sample draws its randomness from its own seed, wherever it is loaded.

The batch samplers (:mod:`.sampler`) hand out ``(index, seed)`` pairs; :class:`Seeded` seeds torch's, numpy's
and Python's global generators with that seed right before ``dataset[index]``. So a data set's own random
augmentation (anything drawing from the global generators, as torchvision-style transforms do) gives the same
sample in the same epoch whether it is loaded by worker 3 of 8 or in the rank itself, and a resumed run is
bitwise equal to an uninterrupted one. In the rank's own process (``workers = 0``) the generators' states are
put back afterwards, so the model's dropout does not depend on the data.

A data set held in memory as tensors may offer the whole batch at once: ``draws_random = False`` and
``gather(indices)`` (a 1-D int64 tensor) returning what ``default_collate`` makes of ``[dataset[i] for i in
indices]``. Its batch is then one indexing per tensor instead of b ``__getitem__`` calls and a stack: on a
GPU, where a small model's step is a few hundred microseconds of replayed kernels, b Python calls per step
are a large part of the host's work (MNIST-1D, 8 learners × 32: 0.75 ms of a step's fetch on the CPU).
"""

from __future__ import annotations

import random
import signal
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate, get_worker_info


class Seeded(Dataset):
    """``dataset`` indexed by ``(index, seed)``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        """The wrapped data set's length."""
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        """Sample ``key[0]`` with every global generator seeded by ``key[1]``."""
        return self._samples([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any] | Gathered:
        """A batch (the DataLoader's batched fetch) for :func:`collate`: the data set's own gather where it
        has one (:func:`gathers`), else its samples, each drawn under its own seed."""
        if gathers(self.dataset):
            index = torch.tensor([index for index, _ in keys], dtype=torch.int64)
            return Gathered(self.dataset.gather(index))
        return self._samples(keys)

    def _samples(self, keys: list[tuple[int, int]]) -> list[Any]:
        """The samples of ``keys``, each drawn under its own seed.

        A data set that declares ``draws_random = False`` (arrays in memory) is read without seeding.
        """
        if not getattr(self.dataset, "draws_random", True):
            return [self.dataset[index] for index, _ in keys]
        if get_worker_info() is not None:  # a worker process: its generators are ours to set
            return [_seeded(self.dataset, index, seed) for index, seed in keys]
        saved = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            return [_seeded(self.dataset, index, seed) for index, seed in keys]
        finally:
            torch.random.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])


class Gathered:
    """A batch a data set gathered whole (:meth:`Seeded.__getitems__`), already in its collated form."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch


def gathers(dataset: Any) -> bool:
    """Whether ``dataset`` gives whole batches: it draws nothing when read and has ``gather(indices)``."""
    return not getattr(dataset, "draws_random", True) and callable(getattr(dataset, "gather", None))


def collate(data: list[Any] | Gathered) -> Any:
    """The DataLoader's ``collate_fn`` over :class:`Seeded`: a gathered batch as it is, samples collated."""
    return data.batch if isinstance(data, Gathered) else default_collate(data)


def _seeded(dataset: Any, index: int, seed: int) -> Any:
    """``dataset[index]`` with torch's, numpy's and Python's global generators seeded by ``seed``."""
    _seed_all(seed)
    return dataset[index]


def _seed_all(seed: int) -> None:
    """Seed torch's, numpy's and Python's global generators."""
    torch.default_generator.manual_seed(seed)  # the CPU generator: 1 µs, torch.manual_seed ~ 90 µs
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)


def quiet_worker(_worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a worker leaves job signals to its rank.

    Slurm sends SIGTERM and SIGUSR1 to every process of a step; a worker must neither die of SIGUSR1 (its
    default action) nor run the rank's handlers, which would write to the rank's wake-up pipe. The rank
    stops its workers itself after it saved its checkpoint.
    """
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
