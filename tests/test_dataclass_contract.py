"""The DataClass contract (what a pool trains from), bound to every implementation: the arrays a model file
loads (``ShardedArrays``, here the digits reader) and the DataLoader pipeline (``LoaderData``, in the rank
and with a worker process). Synchronous rules rely on every point: equal step counts, full batches, an exact
validation cover, a repeatable per-epoch order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from data.digits import Digits
from mpicrossbow.config.sections import DataSection
from mpicrossbow.data.loader import LoaderData, LoaderOptions
from mpicrossbow.data.registry import build_dataset
from mpicrossbow.model.contract import check_data
from mpicrossbow.model.shard import Shard

BATCH, LEARNERS = 16, 4
_SETS = {split: build_dataset("digits", split, {}, DataSection()) for split in ("train", "val")}


def loader(workers: int) -> Callable[[Shard], Any]:
    """LoaderData of the digits by name, loading with ``workers`` processes."""
    return lambda shard: LoaderData(_SETS["train"], _SETS["val"], shard, LoaderOptions(workers=workers))


IMPLEMENTATIONS = {"ShardedArrays": Digits, "LoaderData": loader(0), "LoaderData-worker": loader(1)}


@pytest.fixture(params=list(IMPLEMENTATIONS), scope="module")
def datas(request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    """One DataClass per learner of 4 (2 ranks × 2 learners, say), seed 3."""
    made = [IMPLEMENTATIONS[request.param](Shard(j, LEARNERS, BATCH, seed=3)) for j in range(LEARNERS)]
    yield made
    for data in made:
        getattr(data, "close", lambda: None)()


def test_members_and_equal_step_counts(datas: list[Any]) -> None:
    for data in datas:
        check_data(data, "digits", torch_form=True)
    assert len({d.n_batch_train for d in datas}) == 1 and datas[0].n_batch_train >= 1


def test_an_epoch_is_exactly_n_batch_train_full_batches(datas: list[Any]) -> None:
    for data in datas[:2]:
        batches = list(data.train_batches(0))
        assert len(batches) == data.n_batch_train
        assert all(x.shape[0] == y.shape[0] == BATCH and y.dtype == torch.int64 for x, y in batches)


def test_the_order_repeats_per_epoch_and_changes_between_epochs(datas: list[Any]) -> None:
    first = [y for _, y in datas[1].train_batches(2)]
    again = [y for _, y in datas[1].train_batches(2)]
    other = [y for _, y in datas[1].train_batches(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_validation_slices_cover_the_validation_set_once(datas: list[Any]) -> None:
    seen = sum(len(y) for data in datas for _, y in data.val_batches())
    assert seen == len(_SETS["val"])
    assert sum(d.n_batch_val for d in datas) == sum(1 for d in datas for _ in d.val_batches())
