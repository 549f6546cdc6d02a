"""A data set in memory gives its batch in one gather (mpicrossbow.data.seeded): the very batch the DataLoader
stacks sample by sample, through every path that reads batches."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from models.transformer import Tokens
from mpicrossbow.data.arrays import ArrayDataset
from mpicrossbow.data.loader import LoaderData, LoaderOptions
from mpicrossbow.data.mnist1d import MNIST1D
from mpicrossbow.data.seeded import Gathered, Seeded, collate, gathers
from mpicrossbow.model.shard import Shard


def in_memory() -> dict[str, torch.utils.data.Dataset]:
    """Every built-in data set with ``gather``, small."""
    gen = torch.Generator().manual_seed(0)
    return {
        "arrays": ArrayDataset(torch.randn(40, 8, 8, generator=gen).numpy(), torch.arange(40) % 10, "test"),
        "mnist1d": MNIST1D(torch.randn(40, 40, generator=gen), torch.randint(0, 10, (40,), generator=gen)),
        "tokens": Tokens(40),
    }


@pytest.mark.parametrize("name", sorted(in_memory()))
def test_a_gathered_batch_is_bitwise_the_stacked_one(name: str) -> None:
    dataset = in_memory()[name]
    assert gathers(dataset)
    keys = [(i, 1000 + i) for i in (7, 3, 3, 39, 0)]  # any order, repeats too
    got = Seeded(dataset).__getitems__(keys)
    assert isinstance(got, Gathered)
    want = default_collate([dataset[i] for i, _ in keys])
    for g, w in zip(collate(got), want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    one, want_one = Seeded(dataset)[keys[0]], dataset[7]  # one sample: the data set's own, as it was
    assert torch.equal(one[0], want_one[0]) and int(one[1]) == int(want_one[1])


class Drawing(torch.utils.data.Dataset):
    """Draws random numbers when read, and offers a gather it must not be read by."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.randn(2) + index, index % 3

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("a data set that draws random numbers is read sample by sample")


def test_a_data_set_that_draws_random_numbers_is_read_sample_by_sample() -> None:
    assert not gathers(Drawing())
    samples = Seeded(Drawing()).__getitems__([(1, 5), (2, 6)])
    assert isinstance(samples, list) and len(samples) == 2


@pytest.mark.parametrize("workers", [0, 2], ids=["in the rank", "2 workers"])
def test_the_loaders_batches_are_the_stacked_ones_with_and_without_workers(workers: int) -> None:
    dataset = in_memory()["mnist1d"]
    data = LoaderData(dataset, dataset, Shard(0, 1, 4, seed=3), LoaderOptions(workers=workers))
    try:
        sampler = data.sampler
        sampler.set_epoch(1, 0)
        for keys, (x, y) in zip(sampler, data.train_batches(1), strict=True):
            want = default_collate([dataset[i] for i, _ in keys])
            assert torch.equal(x, want[0]) and torch.equal(y, want[1]) and y.dtype == torch.int64
        val = list(data.val_batches())
        assert sum(len(y) for _, y in val) == len(dataset)
    finally:
        data.close()
