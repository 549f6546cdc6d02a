"""Which image data set a CIFAR-style model file trains on: CIFAR-10, synthetic CIFAR-sized data, or digits.

ResNet and VGG share the choice: CIFAR-10 binary batches when a ``root`` folder is given, deterministic
synthetic data of the same shape when it is not (benchmarks, tests, machines without the data set), and the
bundled 8×8 digits for runs that must learn something real in seconds.
"""

from __future__ import annotations

import logging

from mpicrossbow.model.shard import Shard, ShardedArrays

logger = logging.getLogger(__name__)

#: The ``dataset`` values :func:`image_data` accepts.
DATASETS = ("cifar10", "digits")


def image_shape(dataset: str, image_size: int) -> tuple[int, int, int]:
    """(channels, height, width) of one sample; ``image_size`` 0 means the data set's own size."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if dataset == "digits":
        if image_size not in (0, 8):
            raise ValueError(f"the digits are 8×8; image_size must be 0 or 8, got {image_size}")
        return 1, 8, 8
    side = image_size or 32
    return 3, side, side


def image_data(
    shard: Shard, dataset: str, root: str = "", image_size: int = 0, classes: int = 10
) -> ShardedArrays:
    """This rank's share: CIFAR-10 from ``root``; synthetic CIFAR-shaped data if ``root`` is empty; digits."""
    shape = image_shape(dataset, image_size)
    if dataset == "digits":
        from data.digits import Digits

        return Digits(shard)
    if root:
        if shape != (3, 32, 32) or classes != 10:
            raise ValueError("CIFAR-10 from a root folder is 32×32 with 10 classes")
        from data.cifar import CIFAR10

        return CIFAR10(shard, root)
    from data.synthetic import Synthetic

    logger.info("no CIFAR-10 root given: synthetic %s data with %d classes", shape, classes)
    return Synthetic(shard, shape=shape, classes=classes, seed=shard.seed)
