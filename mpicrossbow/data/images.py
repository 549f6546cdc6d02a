"""Images in the torchvision folder layout: ``root/<split>/<class>/*.jpg`` (or .png, ...), one folder per
class, split ``train`` or ``val``.

The classes are the sorted names of the class folders under ``root/train``, for both splits, so a label
means the same class in each; a validation class folder that training does not have is an error, one it
lacks is not. Files are listed recursively under each class folder, sorted, and only by extension (nothing
is opened when the data set is built); decoding happens in ``__getitem__``. Bad layout is one
:class:`~mpicrossbow.errors.DataError` line naming the folder.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mpicrossbow.data.encoded import EncodedImages
from mpicrossbow.errors import DataError

logger = logging.getLogger(__name__)

#: File name endings (lower case) taken as images; everything else in a class folder is ignored.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".bmp", ".tif", ".tiff", ".webp")


def class_folders(folder: Path) -> list[str]:
    """Sorted names of the sub-folders of ``folder`` (hidden ones left out)."""
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def image_files(folder: Path) -> list[str]:
    """Sorted paths of the image files anywhere under ``folder`` (symbolic links followed)."""
    found = []
    for parent, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [
            os.path.join(parent, f)
            for f in files
            if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")
        ]
    return sorted(found)


def scan(root: Path, split: str) -> tuple[list[str], list[tuple[str, int]]]:
    """The classes (from ``root/train``) and the split's (path, class index) samples, class by class."""
    if not root.is_dir():
        raise DataError(f"[dataset] root '{root}': no such folder")
    for needed in {"train", split}:
        if not (root / needed).is_dir():
            raise DataError(f"{root / needed}: no such folder (the {needed} split of [dataset] root)")
    classes = class_folders(root / "train")
    if not classes:
        raise DataError(f"{root / 'train'}: no class folders (expected train/<class>/<image files>)")
    present = class_folders(root / split)
    unknown = sorted(set(present) - set(classes))
    if unknown:
        raise DataError(f"{root / split / unknown[0]}: class folder not in {root / 'train'}")
    if not present:
        raise DataError(f"{root / split}: no class folders (expected {split}/<class>/<image files>)")
    samples: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        if name not in present:
            continue
        files = image_files(root / split / name)
        if not files:
            raise DataError(f"{root / split / name}: empty class folder (no {'/'.join(IMAGE_EXTENSIONS)})")
        samples += [(path, label) for path in files]
    return classes, samples


class ImageFolder(EncodedImages):
    """One split of an image folder tree: ``samples`` (path, class index), ``targets``, ``classes``."""

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        augment: str = "standard",
        image_size: int = 224,
        on_bad_sample: str = "error",
    ) -> None:
        """List ``root/<split>``'s class folders and image files (nothing is decoded yet)."""
        super().__init__(str(root), split, augment, image_size, on_bad_sample)
        self.root = Path(root)
        self.classes, self.samples = scan(self.root, split)
        self.targets = [label for _, label in self.samples]
        logger.info("%s/%s: %d images of %d classes", self.root, split, len(self.samples), len(self.classes))

    def encoded(self, index: int) -> bytes:
        """The bytes of sample ``index``'s file; a DataError naming it when it cannot be read."""
        path = self.samples[index][0]
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as error:
            raise DataError(f"{path}: cannot read ({error.strerror or error})") from None

    def name(self, index: int) -> str:
        """Sample ``index``'s file path."""
        return self.samples[index][0]

    def header(self, index: int) -> str:
        """Sample ``index``'s file path (Pillow reads only its header)."""
        return self.samples[index][0]
