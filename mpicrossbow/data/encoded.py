"""What :class:`~mpicrossbow.data.images.ImageFolder` and :class:`~mpicrossbow.data.shards.Shards` share:
a labelled, indexed set of encoded images decoded and transformed on access, a policy for bad samples,
and a cheap header check.

A subclass says where sample ``i``'s bytes live (:meth:`EncodedImages.encoded`), what to call it in a
message (:meth:`EncodedImages.name`) and what Pillow may open to read its header
(:meth:`EncodedImages.header`). Decoding happens in ``__getitem__``, so in the DataLoader's workers.

``on_bad_sample = "skip"`` replaces a sample that fails to decode by the next one that decodes (index + 1,
wrapping) and records its name in ``bad_samples`` (of the process that met it: a worker's own copy). A bad
sample is tried again every time it is asked for, never remembered and jumped: the random draws a sample
consumes must not depend on what one worker process has seen before, or runs would differ with the
worker count.
"""

from __future__ import annotations

import logging
from typing import IO

import torch
from PIL import Image
from torch.utils.data import Dataset

from mpicrossbow.data.registry import SPLITS
from mpicrossbow.data.transforms import ImageTransform, UndecodableImage
from mpicrossbow.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

#: The ``on_bad_sample`` policies.
ON_BAD_SAMPLE = ("error", "skip")


class EncodedImages(Dataset):
    """Labelled encoded images: ``dataset[i]`` is (normalised float32 (3, S, S) tensor, class index).

    Subclasses set ``classes`` and ``targets`` and implement :meth:`encoded`, :meth:`name` and
    :meth:`header`.
    """

    #: True when the stored order is already a random permutation (packed shards), so a sampler may cut
    #: contiguous parts without permuting first.
    pre_shuffled: bool = False

    def __init__(self, source: str, split: str, augment: str, image_size: int, on_bad_sample: str) -> None:
        """Check the options and build the split's transform; ``source`` names the data in messages."""
        if split not in SPLITS:
            raise ConfigError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ConfigError(
                f"[dataset] on_bad_sample: expected one of {', '.join(ON_BAD_SAMPLE)}, got {on_bad_sample!r}"
            )
        self.source = source
        self.split = split
        self.on_bad_sample = on_bad_sample
        self.transform = ImageTransform(augment, image_size, train=split == "train")
        self.classes: list[str] = []
        self.targets: list[int] = []
        self.bad_samples: list[str] = []

    def encoded(self, index: int) -> bytes:
        """The encoded bytes of sample ``index``."""
        raise NotImplementedError

    def name(self, index: int) -> str:
        """How messages name sample ``index`` (its file, or its shard and source path)."""
        raise NotImplementedError

    def header(self, index: int) -> str | IO[bytes]:
        """What Pillow opens to check sample ``index``'s header (a path, or a file object)."""
        raise NotImplementedError

    def __len__(self) -> int:
        """Number of samples in the split."""
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index`` decoded and transformed, with its class; bad samples per ``on_bad_sample``."""
        current = index
        for _ in range(len(self)):
            try:
                try:
                    return self.transform.decode(self.encoded(current)), self.targets[current]
                except UndecodableImage as reason:
                    raise DataError(f"{self.name(current)}: not a decodable image ({reason})") from None
            except DataError as error:
                if self.on_bad_sample == "error":
                    raise
                name = self.name(current)
                if name not in self.bad_samples:
                    self.bad_samples.append(name)
                    logger.warning("skipping bad sample %s", error)
                current = (current + 1) % len(self)
        raise DataError(f"{self.source}: no sample of the {self.split} split decodes")

    def verify(self, indices: list[int] | range) -> list[tuple[int, str]]:
        """(index, reason) for each of ``indices`` whose header Pillow cannot read: a cheap check (no pixel
        is decoded) so that a garbage file fails before the first training step, not in the middle."""
        bad = []
        for index in indices:
            try:
                with Image.open(self.header(index)) as image:
                    image.verify()
            except DataError as error:
                bad.append((index, str(error)))
            except Exception as error:  # Pillow raises many types for a bad header; all mean "bad sample"
                bad.append((index, f"{self.name(index)}: not a decodable image ({error})"))
        return bad
