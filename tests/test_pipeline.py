"""The DataLoader pipeline in one process: parts and epoch orders (sampler), the loader (workers, skip,
seeding), the data-set registry, and plain networks entering the model contract."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from user_project.datasets import NoisyDigits
from user_project.net import DigitsNet, digits_net

from mpicrossbow.config import load_config
from mpicrossbow.config.sections import DataSection
from mpicrossbow.data.dataset_model import DatasetModel, check_labels
from mpicrossbow.data.loader import LoaderData, LoaderOptions, pin_memory_for
from mpicrossbow.data.registry import build_dataset
from mpicrossbow.data.sampler import EpochBatches, sample_seeds, train_part, val_part
from mpicrossbow.errors import ConfigError, ContractError, DataError
from mpicrossbow.model.contract import contract_form, load_model_class
from mpicrossbow.model.shard import Shard
from mpicrossbow.training.run.pool_builder import torch_model

NOISY = "user_project.datasets:noisy_digits"


@pytest.mark.parametrize("pre_shuffled", [False, True])
@pytest.mark.parametrize(("n", "size"), [(1000, 1), (1000, 3), (1437, 8), (10, 10)])
def test_parts_are_equal_disjoint_and_fixed(n: int, size: int, pre_shuffled: bool) -> None:
    parts = [train_part(n, Shard(r, size, 1, seed=7), pre_shuffled) for r in range(size)]
    assert {len(p) for p in parts} == {n // size}
    together = np.concatenate(parts)
    assert len(np.unique(together)) == len(together) == n // size * size
    # The session seed never changes who holds what; packed shards are read in runs of consecutive rows.
    assert all(
        np.array_equal(p, train_part(n, Shard(r, size, 1, seed=0), pre_shuffled)) for r, p in enumerate(parts)
    )
    if pre_shuffled:
        assert all(np.array_equal(np.diff(p), np.ones(len(p) - 1)) for p in parts)


def test_spans_tile_the_set_and_val_parts_cover_it_once() -> None:
    spans = [(0.0, 0.5), (0.5, 0.8), (0.8, 1.0)]
    parts = [train_part(1000, Shard(r, 3, 1, span=s)) for r, s in enumerate(spans)]
    assert [len(p) for p in parts] == [500, 300, 200]
    assert len(np.unique(np.concatenate(parts))) == 1000
    vals = [val_part(359, Shard(r, 4, 1)) for r in range(4)]
    assert np.array_equal(np.concatenate(vals), np.arange(359))


def test_epoch_orders_and_sample_seeds_repeat_exactly_and_differ_between_epochs() -> None:
    part = train_part(500, Shard(1, 2, 8))
    a, b = EpochBatches(part, 8, seed=3, learner=1), EpochBatches(part, 8, seed=3, learner=1)
    assert len(a) == 250 // 8
    assert np.array_equal(a.order(4), b.order(4)) and not np.array_equal(a.order(4), a.order(5))
    assert sorted(a.order(4)) == sorted(part)
    assert np.array_equal(sample_seeds(3, 4, part), sample_seeds(3, 4, part))
    assert len(set(sample_seeds(3, 4, part).tolist()) & set(sample_seeds(3, 5, part).tolist())) == 0
    a.set_epoch(4, start=2)
    assert next(iter(a)) == list(
        zip(*[x.tolist() for x in (a.order(4)[16:24], sample_seeds(3, 4, a.order(4)[16:24]))], strict=True)
    )


def batches(data: LoaderData, epoch: int, skip: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = data.train_batches(epoch)
    it.skip(skip)
    return list(it)


def test_workers_do_not_change_a_single_sample_and_skip_loads_nothing_before_its_start() -> None:
    train, val = NoisyDigits("train", noise=0.3), NoisyDigits("val")
    shard = Shard(1, 3, 16, seed=5)
    inline = LoaderData(train, val, shard, LoaderOptions(workers=0))
    parallel = LoaderData(train, val, shard, LoaderOptions(workers=2, prefetch=2))
    try:
        for epoch in (0, 1):
            mine, theirs = batches(inline, epoch), batches(parallel, epoch)
            assert len(mine) == inline.n_batch_train == len(train) // 3 // 16
            for (x0, y0), (x1, y1) in zip(mine, theirs, strict=True):
                assert torch.equal(x0, x1) and torch.equal(y0, y1)
        assert not torch.equal(batches(inline, 0)[0][0], batches(inline, 1)[0][0])  # reshuffled, re-noised
        resumed = batches(parallel, 1, skip=5)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed, batches(inline, 1)[5:], strict=True))
        seen = torch.cat([y for _, y in inline.val_batches()])
        assert len(seen) == len(val_part(len(val), shard))
    finally:
        parallel.close()


def test_loading_in_the_rank_leaves_its_random_generators_alone() -> None:
    data = LoaderData(NoisyDigits("train"), NoisyDigits("val"), Shard(0, 1, 32), LoaderOptions())
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    batches(data, 0)
    assert torch.equal(torch.rand(3), expected)


def test_pin_memory_auto_follows_the_device() -> None:
    assert pin_memory_for("auto", torch.device("cpu")) is False
    assert pin_memory_for("auto", torch.device("cuda", 0)) is True
    assert pin_memory_for("false", torch.device("cuda", 0)) is False


def test_registry_builds_builtins_and_user_factories_with_typed_keys() -> None:
    data = DataSection()
    digits = build_dataset("digits", "train", {}, data)
    assert len(digits) + len(build_dataset("digits", "val", {}, data)) == 1797
    x, y = digits[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and 0 <= int(y) <= 9
    noisy = build_dataset(NOISY, "train", {"noise": "0.5", "label_offset": "0"}, data)
    assert isinstance(noisy, NoisyDigits) and noisy.noise == 0.5


@pytest.mark.parametrize(
    ("name", "params", "error", "message"),
    [
        ("imagenet", {}, ConfigError, "unknown data set 'imagenet'; valid: digits, mnist1d, mnist, cifar10"),
        (
            NOISY,
            {"nois": "1"},
            ConfigError,
            "[dataset] unknown key 'nois'; valid keys: split, noise, label_offset",
        ),
        (NOISY, {"noise": "loud"}, ConfigError, "[dataset] noise: expected a number, got 'loud'"),
        (
            "user_project.datasets:not_a_dataset",
            {},
            ContractError,
            "returned int for split 'train', not a map",
        ),
        ("user_project.datasets:broken", {}, DataError, "No such file or directory: 'nowhere'"),
        ("user_project.nothing:here", {}, ConfigError, "cannot import user_project.nothing"),
        ("mnist", {"root": "/nonexistent"}, DataError, "/nonexistent/train-images-idx3-ubyte: no such file"),
    ],
)
def test_bad_data_sets_are_one_line_naming_the_key_or_file(
    name: str, params: dict[str, str], error: type, message: str
) -> None:
    with pytest.raises(error) as caught:
        build_dataset(name, "train", params, DataSection())
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_plain_networks_and_functions_are_the_module_form() -> None:
    assert contract_form(load_model_class("user_project.net", "DigitsNet")) == "module"
    assert contract_form(load_model_class("user_project.net", "digits_net")) == "module"
    with pytest.raises(ContractError, match="classes and functions there: DigitsNet, digits_net"):
        load_model_class("user_project.net", "Nope")


def cfg(modelclass: str, *overrides: str) -> object:
    text = f"RULE=BSP\nMODELFILE=user_project.net\nMODELCLASS={modelclass}\nDEVICES=cpu\n"
    return load_config(text=text, overrides=overrides)


def test_a_plain_network_without_a_data_set_is_one_line_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"plain network \(no data\(\) of its own\): name its data with \[data\] dataset"
    ):
        torch_model(cfg("DigitsNet"), DigitsNet, torch.device("cpu"), 1)


def test_model_keys_reach_the_network_and_labels_are_checked_against_its_outputs() -> None:
    config = cfg("digits_net", "data.dataset=digits", "model.hidden=16")
    model = torch_model(config, digits_net, torch.device("cpu"), 1)
    assert isinstance(model, DatasetModel)
    net = model.module()
    assert net.body[1].out_features == 16
    assert check_labels(net, model.train_set, "digits", torch.device("cpu")) == 10
    small = DigitsNet(classes=7)
    with pytest.raises(
        DataError, match=r"label 9 is out of range for the model's 7 outputs .*num_classes = 10"
    ):
        check_labels(small, model.train_set, "digits", torch.device("cpu"))
    shifted = NoisyDigits("train", label_offset=3)
    with pytest.raises(DataError, match="label 12 is out of range"):
        check_labels(net, shifted, NOISY, torch.device("cpu"))
    wide = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(100, 10))
    with pytest.raises(DataError, match=r"cannot take a sample of shape \(1, 8, 8\)"):
        check_labels(wide, model.train_set, "digits", torch.device("cpu"))


def test_a_callable_that_returns_no_network_is_a_contract_error() -> None:
    from user_project.net import not_a_network

    model = torch_model(cfg("not_a_network", "data.dataset=digits"), not_a_network, torch.device("cpu"), 1)
    with pytest.raises(ContractError, match=r"not_a_network returned dict, not a torch\.nn\.Module"):
        model.module()


def test_a_part_smaller_than_a_batch_is_one_line() -> None:
    with pytest.raises(DataError, match="fewer than one batch of 512"):
        LoaderData(NoisyDigits("train"), NoisyDigits("val"), Shard(0, 4, 512), LoaderOptions())


def test_mnist_and_cifar10_folders_by_name(tmp_path: Path) -> None:
    from data.cifar import write_cifar10_batch
    from data.idx import write_idx

    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 10)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))
    for name, n in (("data_batch_1.bin", 20), ("data_batch_2.bin", 20), ("test_batch.bin", 8)):
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        write_cifar10_batch(tmp_path / name, x, rng.integers(0, 10, n, dtype=np.uint8))
    data = DataSection()
    mnist = [build_dataset("mnist", split, {"root": str(tmp_path)}, data) for split in ("train", "val")]
    cifar = [build_dataset("cifar10", split, {"root": str(tmp_path)}, data) for split in ("train", "val")]
    assert [len(d) for d in mnist] == [30, 10] and mnist[0][0][0].shape == (1, 28, 28)
    assert [len(d) for d in cifar] == [40, 8] and cifar[0][0][0].shape == (3, 32, 32)
    assert float(mnist[0][0][0].max()) <= 1.0 and cifar[0].classes[0] == "airplane"
