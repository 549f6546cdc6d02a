"""CIFAR-10 in its binary version (``cifar-10-batches-bin``), and the :class:`CIFAR10` data class.

Each batch file is a run of 3,073-byte records: one label byte (0..9), then 3,072 pixel bytes (1,024 red,
1,024 green, 1,024 blue, row-major 32x32). Files are memory-mapped, so a rank reads only its own records.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from mpicrossbow.data.arrays import ArrayDataset
from mpicrossbow.errors import DataError
from mpicrossbow.model.shard import Shard, ShardedArrays, train_indices, val_indices

logger = logging.getLogger(__name__)

#: Bytes per record: the label, then the 3x32x32 image.
RECORD = 1 + 3 * 32 * 32
#: The ten CIFAR-10 class names, in label order.
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
#: Per-channel mean and standard deviation of the CIFAR-10 training images, pixels scaled to [0, 1].
MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32).reshape(1, 3, 1, 1)
STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32).reshape(1, 3, 1, 1)


def cifar10_records(path: str | Path) -> np.ndarray:
    """All records of a batch file as a read-only (N, 3073) uint8 memmap, after checking the file size."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    size = path.stat().st_size
    if size == 0 or size % RECORD:
        raise DataError(
            f"{path}: {size} bytes is not a positive multiple of the {RECORD}-byte CIFAR-10 record"
        )
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(size // RECORD, RECORD))


def read_cifar10_batch(path: str | Path, indices: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) uint8 of a batch file: all records, or only ``indices``."""
    records = cifar10_records(path)
    rows = np.asarray(records if indices is None else records[np.asarray(indices, dtype=np.int64)])
    labels = rows[:, 0].copy()
    if len(labels) and labels.max() > 9:
        raise DataError(f"{path}: label {labels.max()} found, CIFAR-10 labels are 0..9")
    return rows[:, 1:].reshape(-1, 3, 32, 32), labels


def write_cifar10_batch(path: str | Path, x: np.ndarray, y: np.ndarray) -> None:
    """Write images (N, 3, 32, 32) and labels (N,) as a CIFAR-10 binary batch; for tests and tools."""
    x, y = np.asarray(x, dtype=np.uint8), np.asarray(y, dtype=np.uint8)
    if x.shape[1:] != (3, 32, 32) or y.shape != (len(x),):
        raise ValueError(f"expected x (N, 3, 32, 32) and y (N,), got {x.shape} and {y.shape}")
    Path(path).write_bytes(np.concatenate([y[:, None], x.reshape(len(x), -1)], axis=1).tobytes())


def _normalise(x: np.ndarray) -> np.ndarray:
    """uint8 images to float32, scaled to [0, 1] and standardised per channel."""
    return (x.astype(np.float32) / 255.0 - MEAN) / STD


class CIFAR10(ShardedArrays):
    """CIFAR-10 from ``root``: ``data_batch_1.bin``..``data_batch_5.bin`` (those present, in order) for
    training, ``test_batch.bin`` for validation; x float32 (N, 3, 32, 32) normalised per channel, y int64.
    """

    def __init__(self, shard: Shard, root: str | Path, split_seed: int = 0) -> None:
        """Find the batches, deal the training records over the ranks and read only this rank's ones."""
        root = Path(root)
        files = [
            root / f"data_batch_{i}.bin" for i in range(1, 6) if (root / f"data_batch_{i}.bin").is_file()
        ]
        if not files:
            raise DataError(
                f"{root / 'data_batch_1.bin'}: no such file (no CIFAR-10 training batch in {root})"
            )
        starts = np.cumsum([0] + [len(cifar10_records(f)) for f in files])
        rows = train_indices(int(starts[-1]), shard, split_seed)
        parts = [
            read_cifar10_batch(f, rows[(rows >= lo) & (rows < hi)] - lo)
            for f, lo, hi in zip(files, starts[:-1], starts[1:], strict=True)
        ]
        test = root / "test_batch.bin"
        x_val, y_val = read_cifar10_batch(test, val_indices(len(cifar10_records(test)), shard))
        super().__init__(
            _normalise(np.concatenate([x for x, _ in parts])),
            np.concatenate([y for _, y in parts]),
            _normalise(x_val),
            y_val,
            shard,
            source=str(root),
        )


def cifar10_dataset(split: str, root: str) -> ArrayDataset:
    """CIFAR-10's ``train`` (the data batches present) or ``val`` (``test_batch.bin``) from the binary
    batches in ``root`` (``[data] dataset = cifar10``): x float32 (N, 3, 32, 32) normalised, y int64."""
    folder = Path(root)
    if split == "val":
        files = [folder / "test_batch.bin"]
    else:
        files = [
            folder / f"data_batch_{i}.bin" for i in range(1, 6) if (folder / f"data_batch_{i}.bin").is_file()
        ]
        if not files:
            raise DataError(
                f"{folder / 'data_batch_1.bin'}: no such file (no CIFAR-10 training batch in {folder})"
            )
    parts = [read_cifar10_batch(f) for f in files]
    x, y = np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])
    return ArrayDataset(_normalise(x), y, str(folder), classes=list(CLASSES))
