"""Convert scikit-learn's copy of the UCI handwritten digits into ``data/digits.h5`` (run once, committed).

Usage, from the repository root: ``python -m data.prepare_digits [--out data/digits.h5]``. scikit-learn is
needed only here; training reads the HDF5 file and never imports it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from data.hdf5 import write_hdf5

logger = logging.getLogger(__name__)

#: License text stored in the file, as the UCI repository states it.
LICENSE = "CC BY 4.0, UCI ML Repository: Optical Recognition of Handwritten Digits; Alpaydin & Kaynak 1998"
SOURCE = "sklearn.datasets.load_digits() (UCI optdigits test set, 8x8 images, 1797 samples)"


def prepare_digits(out: Path) -> None:
    """Load the 1,797 digits from scikit-learn and write them as x (N,1,8,8) uint8 0..16 and y (N,) uint8."""
    from sklearn.datasets import load_digits  # only this tool needs scikit-learn

    digits = load_digits()
    x = digits.images.astype(np.uint8)[:, None, :, :]
    y = digits.target.astype(np.uint8)
    if not np.array_equal(x[:, 0].astype(np.float64), digits.images) or x.max() > 16:
        raise ValueError("scikit-learn digits are not integers 0..16 as expected")
    write_hdf5(out, x, y, source=SOURCE, license=LICENSE, scale=16)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("digits.h5"), help="output file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    prepare_digits(args.out)


if __name__ == "__main__":
    main()
