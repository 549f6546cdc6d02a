"""The 1,797 8x8 UCI handwritten digits (``digits.h5``, shipped with the repo): a small real data set.

Small enough for tests and laptops, real enough that a model must learn: a logistic regression reaches
about 95 % validation accuracy. Made by :mod:`data.prepare_digits`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from data.hdf5 import hdf5_attrs, hdf5_length, read_hdf5_rows
from mpicrossbow.data.arrays import ArrayDataset
from mpicrossbow.errors import DataError
from mpicrossbow.model.shard import Shard, ShardedArrays, train_indices, val_indices

logger = logging.getLogger(__name__)

#: The file this module reads by default.
DEFAULT_PATH = Path(__file__).with_name("digits.h5")


def split_rows(path: Path, val_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(sorted training rows, sorted validation rows, pixel scale) of the file's fixed split."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_total = hdf5_length(path)
    scale = float(hdf5_attrs(path).get("scale", 0))
    if scale <= 0:
        raise DataError(f"{path}: file attribute 'scale' is missing or not positive")
    perm = np.random.default_rng(split_seed).permutation(n_total)
    n_val = round(n_total * val_fraction)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val]), scale


class Digits(ShardedArrays):
    """This rank's share of the digits: x float32 in [0, 1], shape (N, 1, 8, 8); y int64 labels 0..9.

    The train/validation split is fixed by ``split_seed`` (identical on every rank and independent of the
    session seed, so validation numbers compare across runs); each rank reads only its own rows.
    """

    def __init__(
        self, shard: Shard, path: str | Path | None = None, val_fraction: float = 0.2, split_seed: int = 0
    ) -> None:
        """Split the file, read this rank's train rows and validation slice, and scale the pixels."""
        path = DEFAULT_PATH if path is None else Path(path)
        train_rows, val_rows, scale = split_rows(path, val_fraction, split_seed)
        x_train, y_train = read_hdf5_rows(path, train_rows[train_indices(len(train_rows), shard, split_seed)])
        x_val, y_val = read_hdf5_rows(path, val_rows[val_indices(len(val_rows), shard)])
        if x_train.shape[1:] != (1, 8, 8):
            raise DataError(f"{path}: x rows have shape {x_train.shape[1:]}, expected (1, 8, 8)")
        super().__init__(
            x_train.astype(np.float32) / scale,
            y_train,
            x_val.astype(np.float32) / scale,
            y_val,
            shard,
            source=str(path),
        )


def digits_dataset(
    split: str, path: str | None = None, val_fraction: float = 0.2, split_seed: int = 0
) -> ArrayDataset:
    """The ``train`` or ``val`` part of the digits as one data set (``[data] dataset = digits``).

    The same fixed split as :class:`Digits`: x float32 in [0, 1] of shape (N, 1, 8, 8), y labels 0..9.
    """
    file = DEFAULT_PATH if path is None else Path(path)
    train_rows, val_rows, scale = split_rows(file, val_fraction, split_seed)
    x, y = read_hdf5_rows(file, val_rows if split == "val" else train_rows)
    return ArrayDataset(x.astype(np.float32) / scale, y, str(file))
