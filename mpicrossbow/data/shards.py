"""Packed image shards: a split's encoded images in a few large HDF5 files, and the :class:`Shards` data set.

Layout of a packed folder (written by ``python -m mpicrossbow.data.pack``)::

    index.json                      classes; per split the seed, the shard files and their sample counts,
                                    and every sample's label (so ``targets`` needs no shard opened)
    train-00000-of-00004.h5         datasets ``images`` (variable-length uint8: the encoded file bytes),
    ...                             ``labels`` (int64) and ``paths`` (each sample's path relative to the
    val-00000-of-00001.h5           source split folder); attributes split, shard, shards, count, seed

A split's samples were permuted once with the pack seed and cut into contiguous shards, so the stored
order is already random (``pre_shuffled = True``): a sampler can give each rank a contiguous range, and the
rank opens only the shards its range falls in.

Why HDF5 rather than tar files (webdataset): a sample is read by index anywhere in a shard (tar is read
front to back, which forces shuffle buffers instead of a true per-epoch permutation); the file's own
structure (superblock, B-trees, heaps) makes a truncated or overwritten shard fail loudly on open or read;
per-shard attributes record how it was made; and h5py is already a dependency of the project.

Each shard is opened lazily, on first access in the current process, and kept open in a small per-process
table: DataLoader workers are forked or spawned, and an HDF5 handle must not cross a fork, so the table is
dropped when the process id changes and never pickled.
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import h5py

from mpicrossbow.data.encoded import EncodedImages
from mpicrossbow.errors import DataError

logger = logging.getLogger(__name__)

#: The index file of a packed folder.
INDEX = "index.json"
#: ``format`` of an index.json this module reads.
FORMAT = "mpicrossbow-shards-1"
#: Shard files one process keeps open at most (beyond it the first opened is closed): a rank's range
#: spans about shards ÷ (ranks × learners) + 1 of them; each open file holds a descriptor.
MAX_OPEN = 128
#: What to tell the user when a packed folder is broken.
REPACK = "re-run python -m mpicrossbow.data.pack"


def shard_name(split: str, shard: int, shards: int) -> str:
    """File name of shard ``shard`` (from 0) of ``shards`` of ``split``: ``train-00000-of-00004.h5``."""
    return f"{split}-{shard:05d}-of-{shards:05d}.h5"


def read_index(root: Path) -> dict[str, Any]:
    """The parsed index.json of a packed folder; a DataError naming it when missing or malformed."""
    path = root / INDEX
    if not root.is_dir():
        raise DataError(f"[dataset] root '{root}': no such folder")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(
            f"{path}: no such file (not a packed folder, or packing did not finish; {REPACK})"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: unreadable shard index ({error}); {REPACK}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{path}: not an index of format {FORMAT}; {REPACK}")
    return index


class Shards(EncodedImages):
    """One split of a packed folder: the same members and the same tensors as the ImageFolder it came from."""

    pre_shuffled = True

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        augment: str = "standard",
        image_size: int = 224,
        on_bad_sample: str = "error",
    ) -> None:
        """Read index.json (no shard file is opened until a sample is asked for)."""
        super().__init__(str(root), split, augment, image_size, on_bad_sample)
        self.root = Path(root)
        index = read_index(self.root)
        if split not in index.get("splits", {}):
            raise DataError(f"{self.root / INDEX}: no {split} split (packed: {', '.join(index['splits'])})")
        try:
            entry = index["splits"][split]
            self.classes = [str(c) for c in index["classes"]]
            self.files = [self.root / s["file"] for s in entry["shards"]]
            self.counts = [int(s["count"]) for s in entry["shards"]]
            self.targets = [int(t) for t in entry["labels"]]
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{self.root / INDEX}: malformed ({error!r} in {split}); {REPACK}") from None
        self.offsets = [0]
        for count in self.counts:
            self.offsets.append(self.offsets[-1] + count)
        if len(self.targets) != self.offsets[-1]:
            raise DataError(
                f"{self.root / INDEX}: {split} has {len(self.targets)} labels for "
                f"{self.offsets[-1]} samples; {REPACK}"
            )
        self._open: dict[int, tuple[h5py.File, h5py.Dataset]] = {}  # shard → (file, its images)
        self._pid = os.getpid()
        logger.info("%s/%s: %d images in %d shards", self.root, split, len(self.targets), len(self.files))

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, row) of global sample ``index``."""
        if not 0 <= index < len(self.targets):
            raise IndexError(f"sample {index} out of range for {len(self.targets)} samples")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return shard, index - self.offsets[shard]

    def shard(self, shard: int) -> h5py.File:
        """Shard file ``shard``, opened on first use in this process; a DataError naming it if broken."""
        if self._pid != os.getpid():  # a forked worker: never use the parent's HDF5 handles
            self._open, self._pid = {}, os.getpid()
        if shard not in self._open:
            path = self.files[shard]
            try:
                f = h5py.File(path, "r")
            except OSError as error:
                raise DataError(f"{path}: truncated or corrupt shard ({error}); {REPACK}") from None
            try:
                count = len(f["labels"])
                if len(f["images"]) != count or count != self.counts[shard]:
                    raise OSError(f"{count} samples, index.json says {self.counts[shard]}")
            except (OSError, KeyError) as error:
                f.close()
                raise DataError(f"{path}: truncated or corrupt shard ({error}); {REPACK}") from None
            while len(self._open) >= MAX_OPEN:  # close the shards opened first
                self._open.pop(next(iter(self._open)))[0].close()
            self._open[shard] = (f, f["images"])
        return self._open[shard][0]

    def encoded(self, index: int) -> bytes:
        """The encoded bytes of sample ``index``, read from its shard."""
        shard, row = self.locate(index)
        self.shard(shard)
        try:
            return self._open[shard][1][row].tobytes()
        except (OSError, KeyError) as error:
            raise DataError(f"{self.files[shard]}: truncated or corrupt shard ({error}); {REPACK}") from None

    def name(self, index: int) -> str:
        """``<shard file>[row] (<source path>)`` of sample ``index``."""
        shard, row = self.locate(index)
        try:
            path = self.shard(shard)["paths"][row].decode()
        except (OSError, KeyError, AttributeError):
            path = "?"
        return f"{self.files[shard]}[{row}] ({path})"

    def header(self, index: int) -> io.BytesIO:
        """Sample ``index``'s bytes as a file object for Pillow."""
        return io.BytesIO(self.encoded(index))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (for spawned workers) without the open HDF5 files."""
        state = dict(self.__dict__)
        state["_open"] = {}
        return state

    def close(self) -> None:
        """Close this process's open shard files."""
        for f, _ in self._open.values():
            f.close()
        self._open = {}
