"""The IDX format of MNIST (and Fashion-MNIST), and the :class:`MNIST` data class.

An IDX file is a 4-byte magic number (two zero bytes, a dtype code, the number of dimensions), the
dimensions as big-endian uint32, then the values big-endian, row-major. Plain files are memory-mapped, so a
rank touches only its own rows; ``.gz`` files are decompressed in memory first.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from pathlib import Path

import numpy as np

from mpicrossbow.data.arrays import ArrayDataset
from mpicrossbow.errors import DataError
from mpicrossbow.model.shard import Shard, ShardedArrays, train_indices, val_indices

logger = logging.getLogger(__name__)

#: IDX dtype code -> big-endian numpy dtype.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """The array in an IDX file (``.gz`` allowed); plain files come back as a read-only memmap."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    raw: bytes | None = None
    try:
        if path.suffix == ".gz":
            raw = head = gzip.decompress(path.read_bytes())
        else:
            with path.open("rb") as handle:
                head = handle.read(4 + 4 * 255)  # the longest possible header
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path}: cannot read: {err}") from err
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise DataError(f"{path}: bad IDX magic number {head[:4].hex() or '(empty file)'}, expected 0000xxyy")
    if head[2] not in IDX_DTYPES:
        raise DataError(f"{path}: unknown IDX dtype code 0x{head[2]:02X}")
    dtype, ndim = IDX_DTYPES[head[2]], head[3]
    offset = 4 + 4 * ndim
    if len(head) < offset:
        raise DataError(f"{path}: truncated IDX header ({ndim} dimensions announced)")
    shape = tuple(int(d) for d in np.frombuffer(head[4:offset], dtype=">u4"))
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(raw) if raw is not None else path.stat().st_size
    if actual != expected:
        kind = "truncated" if actual < expected else "has trailing bytes"
        raise DataError(f"{path}: {kind}: {actual} bytes, expected {expected} for {dtype} array {shape}")
    if raw is not None:
        return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(shape)
    if expected == offset:  # an empty array: nothing to map
        return np.empty(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write ``array`` as IDX (gzip-compressed when ``path`` ends in ``.gz``); for tests and tools."""
    array = np.asarray(array)
    codes = {dtype.newbyteorder("="): code for code, dtype in IDX_DTYPES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None:
        raise ValueError(f"IDX cannot store dtype {array.dtype}")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + array.astype(IDX_DTYPES[code]).tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


def _find(root: Path, name: str) -> Path:
    """``root/name``, or ``root/name.gz`` when only the compressed file is there."""
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(f"{root / name}: no such file (nor {name}.gz)")


def _images_labels(root: Path, prefix: str) -> tuple[np.ndarray, np.ndarray, Path]:
    """The (N, H, W) images and (N,) labels of one MNIST part, checked to agree."""
    images_path = _find(root, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(root, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(
            f"{images_path}: images {images.shape} do not match labels {labels.shape} in {labels_path}"
        )
    return images, labels, images_path


class MNIST(ShardedArrays):
    """MNIST from the four IDX files in ``root``: x float32 in [0, 1], shape (N, 1, 28, 28); y int64.

    Training rows are dealt by :func:`train_indices` (seeded by ``split_seed``), validation is the t10k
    set split by :func:`val_indices`. Only this rank's rows are read from plain (memory-mapped) files.
    """

    def __init__(self, shard: Shard, root: str | Path, split_seed: int = 0) -> None:
        """Locate the files, read this rank's rows and scale the pixels."""
        root = Path(root)
        train_x, train_y, source = _images_labels(root, "train")
        val_x, val_y, _ = _images_labels(root, "t10k")
        rows = train_indices(len(train_y), shard, split_seed)
        val_rows = val_indices(len(val_y), shard)
        super().__init__(
            (train_x[rows].astype(np.float32) / 255.0)[:, None],
            train_y[rows],
            (val_x[val_rows].astype(np.float32) / 255.0)[:, None],
            val_y[val_rows],
            shard,
            source=str(source),
        )


def mnist_dataset(split: str, root: str) -> ArrayDataset:
    """MNIST's ``train`` (60,000) or ``val`` (the t10k 10,000) images from the IDX files in ``root``
    (``[data] dataset = mnist``, ``[dataset] root = ...``): x float32 (N, 1, 28, 28) in [0, 1], y int64."""
    images, labels, source = _images_labels(Path(root), "train" if split == "train" else "t10k")
    return ArrayDataset((images.astype(np.float32) / 255.0)[:, None], labels, str(source))
