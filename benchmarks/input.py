"""Input pipeline: images/s of this project's image data sets against what a user writes without it.

Generates ``--images`` 256×256 JPEGs with :mod:`mpicrossbow.data.shapes` in a temporary folder and packs
them into 4 shards, then measures, through a plain ``torch.utils.data.DataLoader(dataset, batch_size=64,
num_workers=W)`` at each W in ``--workers``, in interleaved repeats (medians):

(a) ``ImageFolder`` with the standard training augmentation at 224 (reduced-size JPEG decode when it pays,
    crop and resize in one resample);
(b) the naive dataset a user writes without this project: ``PIL.Image.open(path).convert("RGB")`` (full
    decode), the same random-resized-crop box, ``crop`` then ``resize``, flip, to tensor, normalise;
(c) ``Shards`` over the packed files, same transform as (a).

The first batch of every pass (worker start-up) is not timed. Then a decoder table: ms per image of Pillow
and simplejpeg, full and reduced-size decode, on JPEGs of 256² to 2048×1536, and this project's validation
transform against the naive one (full decode, resize the short side, centre crop).

    python -m benchmarks.input                  # appends to benchmarks/results/input.md
    python -m benchmarks.input --quick          # 512 images, workers 0 and 2, 2 repeats
"""

from __future__ import annotations

import argparse
import io
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from benchmarks.report import append_result
from mpicrossbow.data.images import ImageFolder
from mpicrossbow.data.pack import pack
from mpicrossbow.data.shapes import draw_shape, make_shapes
from mpicrossbow.data.shards import Shards
from mpicrossbow.data.transforms import MEAN, STD, ImageTransform, random_resized_crop_box

BATCH = 64
IMAGE_SIZE = 224
#: JPEG sizes of the decoder table (width, height).
DECODE_SIZES = ((256, 256), (500, 375), (1024, 768), (2048, 1536))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=2048, help="256×256 JPEGs generated (4 classes)")
    parser.add_argument("--workers", default="0,1,2", help="comma-separated DataLoader worker counts")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed passes per setting")
    parser.add_argument("--quick", action="store_true", help="512 images, workers 0,2, 2 repeats")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.workers, args.repeats = 512, "0,2", 2
    return args


class NaiveFolder(Dataset):
    """What a user writes without this project: full decode, crop then resize, flip, to tensor, normalise."""

    def __init__(self, samples: list[tuple[str, int]], image_size: int) -> None:
        """Same file list and output size as the ImageFolder it is compared with."""
        self.samples = samples
        self.size = image_size
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        """Number of samples."""
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Decode, random-resized crop (the same box algorithm), flip, normalise."""
        path, label = self.samples[index]
        image = Image.open(path).convert("RGB")
        box = random_resized_crop_box(*image.size)
        image = image.crop(box).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1).item() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0
        return (x - self.mean) / self.std, label


def images_per_second(dataset: Dataset, workers: int) -> float:
    """One pass over ``dataset`` through a DataLoader; images/s after the first batch."""
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers, shuffle=True)
    count, start = 0, 0.0
    for k, (x, _) in enumerate(loader):
        if k == 0:
            start = time.perf_counter()
        else:
            count += len(x)
    return count / (time.perf_counter() - start)


def loader_table(root: Path, packed: Path, args: argparse.Namespace) -> tuple[str, list[str]]:
    """Median images/s of (a), (b), (c) per worker count, and the ratio lines."""
    folder = ImageFolder(root, "train", image_size=IMAGE_SIZE)
    sets = {
        "(a) ImageFolder": folder,
        "(b) naive": NaiveFolder(folder.samples, IMAGE_SIZE),
        "(c) Shards": Shards(packed, "train", image_size=IMAGE_SIZE),
    }
    lines = [
        "| workers | (a) ImageFolder img/s | (b) naive img/s | (c) Shards img/s | (a) ÷ (b) | (c) ÷ (a) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for workers in (int(w) for w in args.workers.split(",")):
        rates: dict[str, list[float]] = {name: [] for name in sets}
        names = list(sets)
        for r in range(args.repeats):
            for name in names[r % 3 :] + names[: r % 3]:  # rotate the order
                torch.manual_seed(r)
                rates[name].append(images_per_second(sets[name], workers))
        a, b, c = (statistics.median(rates[name]) for name in names)
        lines.append(f"| {workers} | {a:,.0f} | {b:,.0f} | {c:,.0f} | {a / b:.2f} | {c / a:.2f} |")
        ratios.append(f"{workers} workers: (a)/(b) {a / b:.2f}×, (c)/(a) {c / a:.2f}×")
        print(lines[-1], flush=True)
    return "\n".join(lines), ratios


def ms_per_call(fn: Callable[[bytes], Any], blobs: list[bytes], repeats: int) -> float:
    """Median ms per call of ``fn`` over ``blobs``, in ``repeats`` timed passes."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for blob in blobs:
            fn(blob)
        times.append((time.perf_counter() - t0) / len(blobs) * 1e3)
    return statistics.median(times)


def decoders() -> dict[str, Callable[[bytes], Any]]:
    """The decoders and transforms of the decoder table, by column name."""
    import simplejpeg

    def pillow_reduced(data: bytes) -> Image.Image:
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (IMAGE_SIZE, IMAGE_SIZE))
        return image.convert("RGB")

    def naive_val(data: bytes) -> Image.Image:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        short = round(IMAGE_SIZE / 0.875)
        w, h = image.size
        image = image.resize((short, int(short * h / w)) if w <= h else (int(short * w / h), short))
        left, top = (image.width - IMAGE_SIZE) // 2, (image.height - IMAGE_SIZE) // 2
        return image.crop((left, top, left + IMAGE_SIZE, top + IMAGE_SIZE))

    val = ImageTransform("standard", IMAGE_SIZE, train=False)
    return {
        "Pillow full": lambda d: Image.open(io.BytesIO(d)).convert("RGB"),
        "Pillow reduced (draft)": pillow_reduced,
        "simplejpeg full": simplejpeg.decode_jpeg,
        "simplejpeg reduced": lambda d: simplejpeg.decode_jpeg(
            d, min_height=IMAGE_SIZE, min_width=IMAGE_SIZE
        ),
        "simplejpeg full → PIL image": lambda d: Image.fromarray(simplejpeg.decode_jpeg(d)),
        "naive val transform (PIL image)": naive_val,
        "this project's val transform (tensor)": lambda d: val(d, "x"),
    }


def decoder_table(repeats: int) -> str:
    """ms per image of each decoder at each JPEG size (quality 90), and the ratio to Pillow's full decode."""
    columns = decoders()
    lines = [
        "| JPEG | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for width, height in DECODE_SIZES:
        rng = np.random.default_rng(0)
        blobs = []
        for _ in range(8):
            out = io.BytesIO()
            draw_shape("star", max(width, height), rng).resize((width, height)).save(out, "JPEG", quality=90)
            blobs.append(out.getvalue())
        blobs = blobs * max(1, 1_000_000 // (width * height))
        times = {name: [] for name in columns}
        for _ in range(repeats):  # interleaved: every column once per round
            for name, fn in columns.items():
                times[name].append(ms_per_call(fn, blobs, 1))
        base = statistics.median(times["Pillow full"])
        cells = [f"{statistics.median(t):.2f} ms ({statistics.median(t) / base:.2f})" for t in times.values()]
        lines.append(f"| {width}×{height} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def versions_line() -> str:
    """Python, torch, Pillow and simplejpeg versions."""
    import PIL
    import simplejpeg

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, Pillow {PIL.__version__}, "
        f"simplejpeg {simplejpeg.__version__}"
    )


def main() -> int:
    """Generate, pack, measure; print and append the tables to results/input.md."""
    args = parse_args(sys.argv[1:])
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="crossbow-input-") as tmp:
        root = make_shapes(Path(tmp) / "folder", args.images // 4, 1, size=256, classes=4, seed=0)
        packed = Path(tmp) / "packed"
        pack(root, packed, shards=4, seed=0)
        loaders, ratios = loader_table(root, packed, args)
    decode = decoder_table(max(3, args.repeats))
    text = (
        f"{args.images} generated 256×256 JPEGs (shapes, quality 90), standard training augmentation to "
        f"{IMAGE_SIZE}, DataLoader batch {BATCH}, shuffle; median of {args.repeats} interleaved passes, "
        f"the first batch of each pass untimed; torch threads 1.\n\n{loaders}\n\n"
        + "; ".join(ratios)
        + "\n\nDecoders, ms per image (ratio to Pillow full decode in brackets), one process, median of "
        f"interleaved rounds; 'reduced' decodes at the smallest DCT scale keeping ≥ {IMAGE_SIZE} px:\n\n"
        + decode
    )
    print(text)
    if not args.no_write:
        path = append_result("input", "Input pipeline", text, versions_line=versions_line())
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
