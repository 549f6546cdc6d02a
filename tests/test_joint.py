"""One joint fetch for a rank's learners (mpicrossbow.data.joint_batches, .joint_arrays) gives exactly the
learners' own batches."""

from __future__ import annotations

import pytest
import torch

from models.transformer import Tokens
from mpicrossbow.data.joint_arrays import JointArrays
from mpicrossbow.data.joint_batches import JointBatches
from mpicrossbow.data.loader import LoaderData, LoaderOptions
from mpicrossbow.model.shard import Shard, ShardedArrays


class Noisy(torch.utils.data.Dataset):
    """A data set whose samples draw random numbers (augmentation): the per-sample seeds must carry over."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(3) + index, torch.tensor(index % 4)


def learners(dataset: torch.utils.data.Dataset, m: int = 3, **options: object) -> list[LoaderData]:
    """m learners' LoaderData over ``dataset`` (rank 1 of 2), batches of 4."""
    return [
        LoaderData(dataset, dataset, Shard(m + j, 2 * m, 4, seed=7), LoaderOptions(**options))  # type: ignore[arg-type]
        for j in range(m)
    ]


@pytest.mark.parametrize("dataset", [Tokens(60), Noisy()], ids=["arrays", "random-per-sample"])
def test_joint_batches_are_the_learners_own_batches_resumed_too(dataset: torch.utils.data.Dataset) -> None:
    datas = learners(dataset)
    assert JointBatches.serves(datas)
    for epoch, skip in ((0, 0), (1, 2)):
        joint = JointBatches(datas, epoch)
        joint.skip(skip)
        own = [d.train_batches(epoch) for d in datas]
        for batches in own:
            batches.skip(skip)
        for _ in range(min(d.n_batch_train for d in datas) - skip):
            x, y = next(joint)
            parts = [next(batches) for batches in own]
            assert torch.equal(x, torch.stack([p[0] for p in parts]))
            assert torch.equal(y, torch.stack([p[1] for p in parts]))


def test_loaders_with_workers_or_other_data_sets_are_fetched_apart() -> None:
    assert not JointBatches.serves(learners(Tokens(60), workers=1))
    mixed = learners(Tokens(60))[:1] + learners(Tokens(60))[1:]
    assert not JointBatches.serves(mixed)


def array_learners(m: int = 3, n: int = 30, batch: int = 4) -> list[ShardedArrays]:
    """m learners' in-memory shards (rank 1 of 2): learner j holds its own rows, ``n`` of them."""
    gen = torch.Generator().manual_seed(3)
    return [
        ShardedArrays(
            torch.randn(n, 2, 3, generator=gen),
            torch.randint(0, 5, (n,), generator=gen),
            torch.randn(4, 2, 3),
            torch.zeros(4, dtype=torch.int64),
            Shard(m + j, 2 * m, batch, seed=7),
        )
        for j in range(m)
    ]


def test_joint_arrays_are_the_learners_own_batches_resumed_too() -> None:
    datas = array_learners()
    own_arrays = [(d.x_train.clone(), d.y_train.clone()) for d in datas]
    assert JointArrays.serves(datas)
    joint = JointArrays(datas)
    for data, (x, y) in zip(datas, own_arrays, strict=True):  # the stack's rows, the same values
        assert torch.equal(data.x_train, x) and torch.equal(data.y_train, y)
        assert data.x_train.untyped_storage().data_ptr() == joint.x.untyped_storage().data_ptr()
    for epoch, skip in ((0, 0), (1, 2)):
        batches = joint.train_batches(epoch)
        own = [d.train_batches(epoch) for d in datas]
        for _ in range(skip):
            next(batches)
            for it in own:
                next(it)
        count = 0
        for x, y in batches:
            parts = [next(it) for it in own]
            assert torch.equal(x, torch.stack([p[0] for p in parts]))
            assert torch.equal(y, torch.stack([p[1] for p in parts]))
            count += 1
        assert count == datas[0].n_batch_train - skip
        assert all(next(it, None) is None for it in own)


def test_arrays_of_other_sizes_or_drawn_their_own_way_are_fetched_apart() -> None:
    class OwnOrder(ShardedArrays):
        def train_batches(self, epoch: int):  # type: ignore[no-untyped-def]
            yield self.x_train[:4], self.y_train[:4]

    assert not JointArrays.serves(array_learners()[:2] + array_learners(n=31)[2:])
    own = array_learners()
    own[1].__class__ = OwnOrder
    assert not JointArrays.serves(own)
    assert not JointArrays.serves([])
    with pytest.raises(ValueError, match="one size and layout"):
        JointArrays(own)
