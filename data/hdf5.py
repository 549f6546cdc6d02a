"""The project's HDF5 data format: one file, datasets ``x`` (N, ...) and ``y`` (N,), metadata as file attrs.

Each rank reads only its own rows (:func:`read_hdf5_rows`), so a data set never has to fit in one process.
Every h5py failure (missing file, truncated or corrupt file, missing dataset) becomes a one-line
:class:`~mpicrossbow.errors.DataError` naming the file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpicrossbow.errors import DataError

logger = logging.getLogger(__name__)


@contextmanager
def _open(path: str | Path) -> Iterator[h5py.File]:
    """Open ``path`` read-only, turning h5py's OSError/KeyError into a DataError naming the file."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file")
    try:
        with h5py.File(path, "r") as handle:
            yield handle
    except KeyError as err:
        raise DataError(f"{path}: missing HDF5 dataset ({err.args[0] if err.args else err})") from err
    except OSError as err:
        raise DataError(f"{path}: not a readable HDF5 file (truncated or corrupt?): {err}") from err


def _datasets(
    handle: h5py.File, path: str | Path, x_key: str, y_key: str
) -> tuple[h5py.Dataset, h5py.Dataset]:
    """The x and y datasets of an open file, checked to exist and to have the same number of rows."""
    for key in (x_key, y_key):
        if not isinstance(handle.get(key), h5py.Dataset):
            raise DataError(
                f"{path}: missing HDF5 dataset {key!r} (has: {', '.join(handle.keys()) or 'none'})"
            )
    x, y = handle[x_key], handle[y_key]
    if x.ndim < 1 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: {x_key!r} has shape {x.shape} but {y_key!r} has shape {y.shape}")
    return x, y


def hdf5_length(path: str | Path, x_key: str = "x", y_key: str = "y") -> int:
    """Number of rows in the file, after checking that x and y exist and agree."""
    with _open(path) as handle:
        return int(_datasets(handle, path, x_key, y_key)[1].shape[0])


def hdf5_attrs(path: str | Path) -> dict[str, Any]:
    """The file-level attributes (source, license, scale...), so readers can scale pixels as stored."""
    with _open(path) as handle:
        return dict(handle.attrs)


def read_hdf5_rows(
    path: str | Path, indices: np.ndarray, x_key: str = "x", y_key: str = "y"
) -> tuple[np.ndarray, np.ndarray]:
    """Read only rows ``indices`` of x and y, in the order given (duplicates allowed).

    h5py wants strictly increasing selections, so the distinct rows are read sorted and put back in order;
    when they are dense, one contiguous slice is read instead (much faster with compressed chunks).
    """
    rows, inverse = np.unique(np.asarray(indices, dtype=np.int64), return_inverse=True)
    with _open(path) as handle:
        x, y = _datasets(handle, path, x_key, y_key)
        n = y.shape[0]
        if len(rows) and (rows[0] < 0 or rows[-1] >= n):
            raise DataError(f"{path}: rows {rows[0]}..{rows[-1]} asked for, but the file holds {n}")
        if len(rows) == 0:
            xs, ys = np.empty((0, *x.shape[1:]), x.dtype), np.empty(0, y.dtype)
        elif 2 * len(rows) >= rows[-1] - rows[0] + 1:
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            xs, ys = x[lo:hi][rows - lo], y[lo:hi][rows - lo]
        else:
            xs, ys = x[rows], y[rows]
    logger.debug("%s: read %d of %d rows", path, len(rows), n)
    return xs[inverse], ys[inverse]


def write_hdf5(path: str | Path, x: np.ndarray, y: np.ndarray, **attrs: Any) -> None:
    """Write ``x`` and ``y`` as gzip-compressed datasets (shuffle filter on) with ``attrs`` on the file."""
    x, y = np.asarray(x), np.asarray(y)
    if y.ndim != 1 or x.ndim < 1 or x.shape[0] != y.shape[0]:
        raise DataError(
            f"{path}: x has shape {x.shape} but y has shape {y.shape}; expected (N, ...) and (N,)"
        )
    with h5py.File(path, "w") as handle:
        handle.create_dataset("x", data=x, compression="gzip", shuffle=True)
        handle.create_dataset("y", data=y, compression="gzip", shuffle=True)
        handle.attrs.update(attrs)
    logger.info("wrote %d rows to %s", len(y), path)
