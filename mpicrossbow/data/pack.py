"""Pack an image folder tree into HDF5 shards (format: :mod:`mpicrossbow.data.shards`).

    python -m mpicrossbow.data.pack SRC DST --shards N [--seed 0]      (or: crossbow-pack SRC DST ...)

Each split of ``SRC`` (``train``, and ``val`` when present, in :class:`~mpicrossbow.data.images.ImageFolder`
order) is permuted once with ``--seed`` and cut into ``N`` contiguous shards of near-equal size; the files'
bytes are copied as they are (no re-encoding). The same N is used for every split, at most one shard per
sample.

Resumable: a shard is written as ``<name>.partial``, flushed to disk and renamed when complete, and
index.json is written last (and removed first), so a killed run leaves only complete shards and no index.
A re-run skips every complete shard whose split, seed, shard count and sample count match its plan, and
rewrites the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from tqdm import tqdm

from mpicrossbow.data.images import ImageFolder
from mpicrossbow.data.shards import FORMAT, INDEX, shard_name
from mpicrossbow.errors import USAGE_EXIT_CODE, DataError, UsageError

logger = logging.getLogger(__name__)

#: Samples read and written per HDF5 write.
CHUNK = 256


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's) data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(path: Path, split: str, shard: int, shards: int, count: int, seed: int) -> bool:
    """True when ``path`` is a finished shard made by the same plan (a broken file is not)."""
    if not path.is_file():
        return False
    try:
        with h5py.File(path, "r") as f:
            made = (f.attrs["split"], int(f.attrs["shard"]), int(f.attrs["shards"]), int(f.attrs["seed"]))
            return made == (split, shard, shards, seed) and len(f["labels"]) == len(f["images"]) == count
    except (OSError, KeyError, ValueError) as error:
        logger.warning("%s: unreadable (%s), rewriting it", path, error)
        return False


def write_shard(path: Path, folder: ImageFolder, rows: np.ndarray, attrs: dict[str, Any], bar: tqdm) -> None:
    """Write samples ``rows`` of ``folder`` into shard ``path`` through ``<path>.partial``, then rename."""
    partial = path.with_name(path.name + ".partial")
    base = Path(folder.root) / folder.split
    with h5py.File(partial, "w") as f:
        images = f.create_dataset("images", (len(rows),), dtype=h5py.vlen_dtype(np.dtype(np.uint8)))
        f.create_dataset("labels", data=np.array([folder.targets[r] for r in rows], dtype=np.int64))
        paths = [os.path.relpath(folder.samples[r][0], base) for r in rows]
        f.create_dataset("paths", data=paths, dtype=h5py.string_dtype())
        for start in range(0, len(rows), CHUNK):
            part = rows[start : start + CHUNK]
            blobs = np.empty(len(part), dtype=object)
            for k, row in enumerate(part):
                blobs[k] = np.frombuffer(folder.encoded(int(row)), dtype=np.uint8)
            if len(part) == 1:  # h5py cannot broadcast a one-element object array into a vlen slice
                images[start] = blobs[0]
            else:
                images[start : start + len(part)] = blobs
            bar.update(len(part))
        for key, value in {**attrs, "count": len(rows)}.items():
            f.attrs[key] = value
    fsync_path(partial)
    os.replace(partial, path)
    fsync_path(path.parent)


def pack_split(folder: ImageFolder, dst: Path, shards: int, seed: int, bar: tqdm) -> dict[str, Any]:
    """Pack one split; its index.json entry."""
    split = folder.split
    order = np.random.default_rng(seed).permutation(len(folder))
    entries = []
    for shard, rows in enumerate(np.array_split(order, shards)):
        path = dst / shard_name(split, shard, shards)
        if is_complete(path, split, shard, shards, len(rows), seed):
            logger.info("%s: complete, skipped", path)
            bar.update(len(rows))
        else:
            attrs = {"split": split, "shard": shard, "shards": shards, "seed": seed, "format": FORMAT}
            write_shard(path, folder, rows, attrs, bar)
        entries.append({"file": path.name, "count": len(rows)})
    labels = [folder.targets[r] for r in order]
    return {"seed": seed, "shards": entries, "labels": labels, "classes": folder.classes}


def pack(src: str | Path, dst: str | Path, shards: int, seed: int = 0) -> Path:
    """Pack ``src``'s train (and val) splits into ``shards`` shards each under ``dst``; the index path."""
    src, dst = Path(src), Path(dst)
    splits = ["train"] + (["val"] if (src / "val").is_dir() else [])
    folders = {split: ImageFolder(src, split) for split in splits}
    sizes = {split: len(folder) for split, folder in folders.items()}
    if shards < 1 or shards > min(sizes.values()):
        raise DataError(
            f"{src}: --shards must be 1..{min(sizes.values())} (the smallest split), got {shards}"
        )
    dst.mkdir(parents=True, exist_ok=True)
    index_path = dst / INDEX
    if index_path.exists():
        logger.info("%s: removed; written again when every shard is complete", index_path)
        index_path.unlink()
    index: dict[str, Any] = {"format": FORMAT, "source": str(src.resolve()), "splits": {}}
    with tqdm(total=sum(sizes.values()), unit="img", disable=not sys.stderr.isatty(), desc="pack") as bar:
        for split in splits:
            entry = pack_split(folders[split], dst, shards, seed, bar)
            index["classes"] = entry.pop("classes")
            index["splits"][split] = entry
    tmp = index_path.with_name(INDEX + ".partial")
    tmp.write_text(json.dumps(index), encoding="utf-8")
    fsync_path(tmp)
    os.replace(tmp, index_path)
    fsync_path(dst)
    logger.info("packed %s into %s: %s", src, dst, ", ".join(f"{s} {n} images" for s, n in sizes.items()))
    return index_path


def main(argv: list[str] | None = None) -> int:
    """``crossbow-pack SRC DST --shards N [--seed S]``: pack an image folder tree; 2 on bad input."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", help="image folder tree (SRC/train/<class>/..., SRC/val/<class>/...)")
    parser.add_argument("dst", help="folder to write the shards and index.json into")
    parser.add_argument("--shards", type=int, required=True, help="shards per split")
    parser.add_argument("--seed", type=int, default=0, help="seed of the one-time permutation")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        pack(args.src, args.dst, args.shards, args.seed)
    except UsageError as error:
        logger.error("%s", error)
        return USAGE_EXIT_CODE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
