"""MNIST-1D (Greydanus 2020) as a dataset factory, generated locally and cached in one HDF5 file.

``[data] dataset = mnist1d`` calls :func:`mnist1d` with the ``[dataset]`` keys. The samples come from the
``mnist1d`` package's own generator (``mnist1d.data.make_dataset``, the paper's defaults but for the
overrides here), never from a download: 40-point signals of 10 classes; the defaults give the paper's
4,000 training and 1,000 validation samples.

The factory runs on every rank at once, so the cache is written without coordination: each process that
finds no cache file generates the data (deterministic: the same arguments give the same bytes), writes a
temporary file in the cache folder, fsyncs it and renames it onto the final name. A rename is atomic, so a
reader sees no file or a complete one, and concurrent writers leave one good file. The generator seeds
NumPy's and ``random``'s global state; both are restored afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from mpicrossbow.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

#: The class names (the digits the templates draw).
CLASSES = tuple(str(d) for d in range(10))
#: Signal length of MNIST-1D (the generator's ``final_seq_length``).
LENGTH = 40
#: Bump when the cache file's layout changes; part of the file name.
CACHE_VERSION = 1


class MNIST1D(Dataset):
    """One split of MNIST-1D in memory: ``(float32 tensor (40,), int label)`` pairs.

    ``data`` is ``(N, 40)`` float32, ``targets`` ``(N,)`` int64, ``classes`` the 10 class names.
    """

    #: Reading a sample draws no random numbers: the pipeline need not seed per sample.
    draws_random = False

    def __init__(self, data: torch.Tensor, targets: torch.Tensor) -> None:
        self.data, self.targets, self.classes = data, targets, list(CLASSES)

    def __len__(self) -> int:
        """The number of samples."""
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index``: its signal and its label."""
        return self.data[index], int(self.targets[index])

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``indices``, one indexing each: what the DataLoader would stack sample by sample."""
        return self.data[indices], self.targets[indices].to(torch.int64)


def mnist1d(
    split: str,
    *,
    cache: str = "data/mnist1d",
    num_samples: int = 5000,
    seed: int = 42,
    train_split: float = 0.8,
) -> MNIST1D:
    """The ``split`` (``train`` or ``val``) of MNIST-1D generated with these arguments, from ``cache``.

    ``num_samples`` samples in all (rounded down to a multiple of 10: the generator makes the same number
    per class), the first ``train_split`` of them for training, the rest for validation; ``seed`` seeds the
    generator. The first call with an argument set generates and caches it (about a second for 5,000).
    """
    if split not in ("train", "val"):
        raise ConfigError(f"mnist1d: split must be 'train' or 'val', got {split!r}")
    overrides = checked_overrides(num_samples, seed, train_split)
    path = Path(cache) / f"mnist1d-{num_samples}-{seed}-{train_split:g}-v{CACHE_VERSION}.h5"
    arrays = read_cache(path, overrides) if path.exists() else None
    if arrays is None:
        arrays = generate(overrides)
        write_atomically(path, arrays, overrides)
        logger.info("mnist1d: generated %d samples into %s", len(arrays["y"]) + len(arrays["y_test"]), path)
    x, y = (arrays["x"], arrays["y"]) if split == "train" else (arrays["x_test"], arrays["y_test"])
    return MNIST1D(
        torch.from_numpy(np.ascontiguousarray(x, np.float32)), torch.from_numpy(y.astype(np.int64))
    )


def checked_overrides(num_samples: int, seed: int, train_split: float) -> dict[str, Any]:
    """The generator arguments that differ from the package's defaults, or a ConfigError naming the key."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 20:
        raise ConfigError(f"[dataset] num_samples must be an integer >= 20 for mnist1d, got {num_samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"[dataset] seed must be an integer >= 0 for mnist1d, got {seed!r}")
    total = num_samples // 10 * 10
    if not isinstance(train_split, int | float) or not 0 < int(total * train_split) < total:
        raise ConfigError(
            f"[dataset] train_split must leave both splits non-empty for mnist1d ({total} samples), "
            f"got {train_split!r}"
        )
    return {"num_samples": num_samples, "seed": seed, "train_split": float(train_split)}


@contextlib.contextmanager
def global_rng_preserved() -> Iterator[None]:
    """Restore NumPy's and ``random``'s global generators after the block (the generator reseeds both)."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def generate(overrides: dict[str, Any]) -> dict[str, np.ndarray]:
    """MNIST-1D from the ``mnist1d`` package's own generator: ``x``, ``y``, ``x_test``, ``y_test``."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:
        raise DataError(f"mnist1d: the 'mnist1d' package is needed to generate the data set ({exc})") from exc
    args = get_dataset_args()
    for key, value in overrides.items():
        setattr(args, key, value)
    with global_rng_preserved():
        made = make_dataset(args)
    return {key: np.asarray(made[key]) for key in ("x", "y", "x_test", "y_test")}


def fingerprint(overrides: dict[str, Any]) -> str:
    """A short hash of the generator arguments, stored in the file and checked when it is read."""
    return hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:16]


def read_cache(path: Path, overrides: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The arrays of a cache file, or None (logged) when it is unreadable or made from other arguments."""
    try:
        with h5py.File(path, "r") as handle:
            if handle.attrs.get("arguments") != fingerprint(overrides):
                logger.warning("mnist1d: %s was made from other arguments; regenerating it", path)
                return None
            return {key: handle[key][()] for key in ("x", "y", "x_test", "y_test")}
    except (OSError, KeyError) as exc:
        logger.warning("mnist1d: cannot read %s (%s); regenerating it", path, exc)
        return None


def write_atomically(path: Path, arrays: dict[str, np.ndarray], overrides: dict[str, Any]) -> None:
    """Write ``arrays`` to a temporary file beside ``path``, fsync it, rename it onto ``path``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise DataError(f"mnist1d: cannot write the cache folder {path.parent}: {exc}") from exc
    try:
        with os.fdopen(fd, "wb") as raw:
            with h5py.File(raw, "w") as handle:
                for key, value in arrays.items():
                    handle.create_dataset(key, data=value)
                handle.attrs["arguments"] = fingerprint(overrides)
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(temporary, 0o644)  # mkstemp makes it 0600; other users of a shared cache read it too
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
