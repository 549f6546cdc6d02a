"""Disks a job writes to: checked before training, and their refusals told in one line while training.

* :func:`check_writable` runs on every rank before the ranks agree to start (so a bad folder is bad input:
  exit 2, one line): the folder is created if needed and a file is written and removed in it.
* :func:`check_room` compares a folder's free space with the bytes one checkpoint needs.
* :func:`storage_error` turns a failed write — ``ENOSPC``/``EDQUOT``/``EROFS``, also when torch's zip writer
  hides the ``OSError`` behind ``unexpected pos`` — into a :class:`~mpicrossbow.errors.StorageError` naming
  the folder, the bytes needed and the bytes free.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError, StorageError

#: errno values that mean "the disk will not take this write".
REFUSALS = {errno.ENOSPC: "out of space", errno.EDQUOT: "over quota", errno.EROFS: "read-only file system"}

MB = 1 << 20


def check_writable(folder: Path, what: str) -> None:
    """Create ``folder`` if needed and write a file there; a ConfigError naming ``what`` when impossible."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".xbow-write-test-") as file:
            file.write(b"x")
            file.flush()
    except OSError as exc:
        raise ConfigError(f"{what} {folder}: cannot write there: {exc.strerror or exc}") from None


def free_bytes(folder: Path) -> int:
    """Free bytes for this user on ``folder``'s file system (of its nearest existing parent)."""
    for path in (folder, *folder.parents):
        if path.exists():
            return shutil.disk_usage(path).free
    return 0


def tensor_bytes(obj: Any) -> int:
    """Bytes of all tensors inside a nested state (dicts, lists, tuples): what a checkpoint file holds."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def check_room(folder: Path, needed: int, what: str) -> None:
    """A ConfigError when ``folder`` has less free space than ``needed`` bytes."""
    free = free_bytes(folder)
    if free < needed:
        raise ConfigError(
            f"{what} {folder}: {free / MB:.1f} MB free, one checkpoint needs about {needed / MB:.1f} MB"
        )


def _errnos(exc: BaseException) -> Iterable[int]:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            yield seen.errno
        seen = seen.__cause__ or seen.__context__


def storage_error(exc: BaseException, path: Path, needed: int) -> StorageError | None:
    """The StorageError for a failed write of ``path`` (about ``needed`` bytes), or None if not a refusal."""
    free = free_bytes(path.parent)
    refused = next((REFUSALS[e] for e in _errnos(exc) if e in REFUSALS), None)
    if refused is None and free >= needed:
        return None  # not the disk: let the real error speak
    return StorageError(
        f"{refused or 'out of space'} writing {path}: needs about {needed / MB:.1f} MB, "
        f"{free / MB:.1f} MB free in {path.parent}"
    )
