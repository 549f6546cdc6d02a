"""One joint fetch for a rank's learners (mpicrossbow.data.joint) gives exactly the learners' own batches."""

from __future__ import annotations

import pytest
import torch

from models.transformer import Tokens
from mpicrossbow.data.joint import JointBatches
from mpicrossbow.data.loader import LoaderData, LoaderOptions
from mpicrossbow.model.shard import Shard


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
