"""Unit tests for the shard arithmetic, the batch iterators and every data reader (no MPI, a few seconds)."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from data.cifar import CIFAR10, read_cifar10_batch, write_cifar10_batch
from data.digits import DEFAULT_PATH, Digits
from data.hdf5 import hdf5_length, read_hdf5_rows, write_hdf5
from data.idx import MNIST, read_idx, write_idx
from data.synthetic import Synthetic
from models.mlp import MLP
from mpicrossbow.errors import DataError
from mpicrossbow.model.shard import Shard, ShardedArrays, train_indices, val_indices
from mpicrossbow.pool.serial import learner_data
from mpicrossbow.pool.spec import PoolSpec


def raises_data_error(
    path: Path | str, func: Callable[..., object], *args: object, **kwargs: object
) -> DataError:
    """Call ``func`` and check it raises a one-line DataError naming ``path``."""
    with pytest.raises(DataError) as info:
        func(*args, **kwargs)
    message = str(info.value)
    assert str(path) in message and "\n" not in message, message
    return info.value


# --- shard arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n_total", [10, 103])
def test_shard_math(size: int, n_total: int) -> None:
    train = [train_indices(n_total, Shard(r, size, 1), split_seed=7) for r in range(size)]
    assert {len(t) for t in train} == {n_total // size}
    assert all(np.array_equal(t, np.sort(t)) for t in train)
    everything = np.concatenate(train)
    assert len(np.unique(everything)) == len(everything) and everything.max() < n_total
    assert np.array_equal(train[0], train_indices(n_total, Shard(0, size, 1, seed=99), split_seed=7))
    val = [val_indices(n_total, Shard(r, size, 1)) for r in range(size)]
    assert np.array_equal(np.concatenate(val), np.arange(n_total))
    assert max(map(len, val)) - min(map(len, val)) <= 1


def test_spans_split_the_training_set_by_fractions() -> None:
    """A data-sharding file's spans: rows [⌊start·n⌋, ⌊end·n⌋) of the shuffled set; spans that tile [0, 1]
    give every row to exactly one shard, and a rank's learners split its span (GSP's shares)."""
    spans = [(0.0, 0.5), (0.5, 0.8), (0.8, 1.0)]
    parts = [train_indices(103, Shard(r, 3, 1, span=span), split_seed=7) for r, span in enumerate(spans)]
    assert [len(p) for p in parts] == [51, 31, 21]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(103))
    datas, steps = learner_data(MLP(hidden=8), PoolSpec(1, 3, 8, seed=0, learners=2, span=(0.5, 0.9)))
    shares = [d.shard.span for d in datas]
    assert shares == [(0.5, 0.7), (0.7, 0.9)] and steps == min(d.n_batch_train for d in datas)
    with pytest.raises(ValueError, match="span 0 <= start < end <= 1"):
        Shard(0, 1, 1, span=(0.5, 0.5))


@pytest.mark.parametrize("kwargs", [{"rank": 2, "size": 2}, {"rank": -1, "size": 2}, {"batch_size": 0}])
def test_shard_rejects_bad_values(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Shard(**{"rank": 0, "size": 1, "batch_size": 4, **kwargs})


def small(shard: Shard, n_train: int = 10, n_val: int = 7) -> ShardedArrays:
    """Arrays whose x row equals its y label, so batches can be checked for alignment."""
    y_train, y_val = np.arange(n_train), 100 + np.arange(n_val)
    return ShardedArrays(y_train[:, None], y_train, y_val[:, None], y_val, shard)


def test_batches_and_reshuffle() -> None:
    data = small(Shard(0, 2, 3, seed=5))
    assert (data.n_train, data.n_val, data.n_batch_train, data.n_batch_val) == (10, 7, 3, 3)
    epoch0 = list(data.train_batches(0))
    assert len(epoch0) == 3 and all(x.shape == (3, 1) and x.dtype == torch.float32 for x, _ in epoch0)
    assert all(y.dtype == torch.int64 and torch.equal(x[:, 0].long(), y) for x, y in epoch0)
    order = [torch.cat([y for _, y in data.train_batches(e)]) for e in (0, 0, 1)]
    assert len(set(order[0].tolist())) == 9
    assert torch.equal(order[0], order[1]) and not torch.equal(order[0], order[2])
    other_rank = torch.cat([y for _, y in small(Shard(1, 2, 3, seed=5)).train_batches(0)])
    assert not torch.equal(order[0], other_rank)
    val = list(data.val_batches())
    assert [len(y) for _, y in val] == [3, 3, 1]
    assert torch.cat([y for _, y in val]).tolist() == list(range(100, 107))
    assert list(small(Shard(0, 1, 3), n_val=0).val_batches()) == []


def test_shard_smaller_than_batch() -> None:
    error = raises_data_error("data set", small, Shard(0, 4, 11))
    assert "10" in str(error) and "11" in str(error)
    raises_data_error(DEFAULT_PATH, Digits, Shard(0, 4, 512))


# --- the shipped digits ----------------------------------------------------------------------------------


def test_digits_file() -> None:
    assert hdf5_length(DEFAULT_PATH) == 1797
    data = Digits(Shard(0, 1, 32))
    assert data.n_train + data.n_val == 1797 and data.n_val == 359
    assert data.x_train.shape == (data.n_train, 1, 8, 8) and data.x_val.dtype == torch.float32
    for x, y in ((data.x_train, data.y_train), (data.x_val, data.y_val)):
        assert x.min() == 0.0 and x.max() == 1.0
        assert set(y.tolist()) == set(range(10))


def test_digits_shards_cover_the_split() -> None:
    whole = Digits(Shard(0, 1, 8))
    parts = [Digits(Shard(r, 3, 8, seed=r)) for r in range(3)]
    assert {p.n_train for p in parts} == {whole.n_train // 3}
    assert torch.equal(torch.cat([p.x_val for p in parts]), whole.x_val)
    assert torch.equal(torch.cat([p.y_val for p in parts]), whole.y_val)


def test_digits_are_learnable() -> None:
    torch.manual_seed(0)
    data = Digits(Shard(0, 1, 32))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(8):
        for x, y in data.train_batches(epoch):
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimiser.step()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in data.val_batches())
    assert correct / data.n_val > 0.9


# --- HDF5 ------------------------------------------------------------------------------------------------


def test_hdf5_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.h5"
    x = np.arange(50 * 2).reshape(50, 2)
    write_hdf5(path, x, np.arange(50), scale=1)
    for rows in ([3, 1, 3], [0, 49], list(range(10, 30)), []):
        xs, ys = read_hdf5_rows(path, np.array(rows, dtype=np.int64))
        assert np.array_equal(ys, rows) and np.array_equal(xs, x[rows])
    raises_data_error(path, read_hdf5_rows, path, np.array([50]))


def test_hdf5_bad_files(tmp_path: Path) -> None:
    raises_data_error(tmp_path / "none.h5", hdf5_length, tmp_path / "none.h5")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    raises_data_error(junk, read_hdf5_rows, junk, np.arange(3))
    cut = tmp_path / "cut.h5"
    cut.write_bytes(DEFAULT_PATH.read_bytes()[:20000])
    raises_data_error(cut, Digits, Shard(0, 1, 8), cut)
    nokey = tmp_path / "nokey.h5"
    with h5py.File(nokey, "w") as handle:
        handle["x"] = np.zeros((4, 2))
    assert "'y'" in str(raises_data_error(nokey, hdf5_length, nokey))
    raises_data_error(nokey, read_hdf5_rows, nokey, np.arange(2), y_key="labels")
    mismatch = tmp_path / "mismatch.h5"
    with h5py.File(mismatch, "w") as handle:
        handle["x"], handle["y"] = np.zeros((4, 2)), np.zeros(3)
    raises_data_error(mismatch, hdf5_length, mismatch)


# --- IDX / MNIST -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["u1", "i1", "i2", "i4", "f4", "f8"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path: Path, dtype: str, suffix: str) -> None:
    array = (np.arange(24) - 5).reshape(2, 3, 4).astype(dtype)
    path = tmp_path / f"a-idx3{suffix}"
    write_idx(path, array)
    back = read_idx(path)
    assert back.shape == (2, 3, 4) and np.array_equal(back, array)
    assert isinstance(back, np.memmap) == (suffix == "")


def test_idx_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "images-idx3-ubyte"
    write_idx(path, np.zeros((5, 4, 4), np.uint8))
    good = path.read_bytes()
    path.write_bytes(good[:-3])
    assert "truncated" in str(raises_data_error(path, read_idx, path))
    path.write_bytes(b"\x01\x00" + good[2:])
    assert "magic" in str(raises_data_error(path, read_idx, path))
    path.write_bytes(b"\x00\x00\x07" + good[3:])
    assert "dtype" in str(raises_data_error(path, read_idx, path))
    gz = tmp_path / "images-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(good)[:-10])
    raises_data_error(gz, read_idx, gz)
    raises_data_error(tmp_path / "missing", read_idx, tmp_path / "missing")


def write_mnist(root: Path, n_train: int, n_test: int) -> None:
    """Tiny MNIST files whose every pixel is 20 * label, train plain and t10k gzipped."""
    for prefix, n, suffix in (("train", n_train, ""), ("t10k", n_test, ".gz")):
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
        write_idx(
            root / f"{prefix}-images-idx3-ubyte{suffix}", np.repeat(20 * labels, 28 * 28).reshape(n, 28, 28)
        )


def test_mnist(tmp_path: Path) -> None:
    write_mnist(tmp_path, 23, 9)
    parts = [MNIST(Shard(r, 2, 4), tmp_path) for r in range(2)]
    assert [p.n_train for p in parts] == [11, 11] and [p.n_val for p in parts] == [5, 4]
    for p in parts:
        assert p.x_train.shape == (11, 1, 28, 28)
        for x, y in ((p.x_train, p.y_train), (p.x_val, p.y_val)):
            assert torch.allclose(x[:, 0, 5, 5] * 255, 20 * y.float())
    assert torch.equal(torch.cat([p.y_val for p in parts]), torch.arange(9) % 10)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    raises_data_error(tmp_path / "t10k-labels-idx1-ubyte", MNIST, Shard(0, 1, 4), tmp_path)


# --- CIFAR-10 ----------------------------------------------------------------------------------------------


def write_cifar(path: Path, labels: np.ndarray) -> None:
    """A CIFAR batch whose channel c of image i is filled with label*20 + c."""
    x = (labels[:, None, None, None] * 20 + np.arange(3)[None, :, None, None]) * np.ones((1, 3, 32, 32))
    write_cifar10_batch(path, x.astype(np.uint8), labels)


def test_cifar_round_trip_and_class(tmp_path: Path) -> None:
    labels = np.arange(12, dtype=np.uint8) % 10
    for name, lab in (
        ("data_batch_1.bin", labels),
        ("data_batch_2.bin", labels[:7]),
        ("test_batch.bin", labels),
    ):
        write_cifar(tmp_path / name, lab)
    x, y = read_cifar10_batch(tmp_path / "data_batch_1.bin")
    assert x.shape == (12, 3, 32, 32) and np.array_equal(y, labels) and x[3, 2, 31, 31] == 3 * 20 + 2
    x, y = read_cifar10_batch(tmp_path / "data_batch_1.bin", np.array([5, 1]))
    assert np.array_equal(y, [5, 1]) and np.array_equal(x[:, 1, 0, 0], [101, 21])
    parts = [CIFAR10(Shard(r, 3, 2), tmp_path) for r in range(3)]
    assert [p.n_train for p in parts] == [6, 6, 6] and sum(p.n_val for p in parts) == 12
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3)
    for p in parts:
        pixels = p.x_train[:, :, 0, 0] * std + mean
        assert torch.allclose(pixels * 255, p.y_train[:, None] * 20.0 + torch.arange(3), atol=1e-3)


def test_cifar_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1.bin"
    path.write_bytes(bytes(3073 * 2 + 5))
    assert "3073" in str(raises_data_error(path, read_cifar10_batch, path))
    path.write_bytes(bytes([10]) + bytes(3072))
    raises_data_error(path, read_cifar10_batch, path)
    raises_data_error(tmp_path / "test_batch.bin", read_cifar10_batch, tmp_path / "test_batch.bin")
    raises_data_error(tmp_path / "empty" / "data_batch_1.bin", CIFAR10, Shard(0, 1, 1), tmp_path / "empty")


# --- synthetic ----------------------------------------------------------------------------------------------


def test_synthetic() -> None:
    whole = Synthetic(Shard(0, 1, 16), shape=(2, 4, 4), classes=3, n_train=64, n_val=20, seed=3)
    again = Synthetic(Shard(0, 1, 16), shape=(2, 4, 4), classes=3, n_train=64, n_val=20, seed=3)
    assert torch.equal(whole.x_train, again.x_train) and whole.x_train.shape == (64, 2, 4, 4)
    parts = [
        Synthetic(Shard(r, 2, 16), shape=(2, 4, 4), classes=3, n_train=64, n_val=20, seed=3) for r in (0, 1)
    ]
    assert torch.equal(torch.cat([p.x_val for p in parts]), whole.x_val)
    rows = train_indices(64, Shard(1, 2, 16), 3)
    assert torch.equal(parts[1].x_train, whole.x_train[rows]) and set(whole.y_train.tolist()) == {0, 1, 2}
