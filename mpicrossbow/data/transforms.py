"""Image transforms without torchvision: encoded bytes in, a normalised float32 CHW tensor out.

``augment = "standard"`` is the ImageNet recipe: training images get a random-resized crop (area scale
(0.08, 1), aspect ratio (3/4, 4/3), torchvision's algorithm: 10 tries, then a centre crop) to
``image_size`` and a horizontal flip with probability ½; validation images have their short side resized
to ``round(image_size / 0.875)`` and are centre-cropped to ``image_size``. ``augment = "none"`` resizes the
whole image to ``image_size``×``image_size``. Both end as float in [0, 1], normalised with the ImageNet
mean and standard deviation.

Randomness comes only from torch's global RNG (``torch.rand``, ``torch.randint``), never from a generator of
its own: the loader seeds that RNG from (seed, epoch, index) right before it asks for a sample, so an
augmented sample is the same whichever DataLoader worker draws it and a resumed run repeats it bit for bit.
The crop is drawn from the image's header size, before any pixel is decoded.

Speed. The crop box is known before decoding, so a JPEG is decoded at reduced size when the crop is much
larger than the output (libjpeg's DCT scaling by 1/2, 1/4 or 1/8, Pillow's ``Image.draft``), keeping at
least :data:`DRAFT_GAP` × ``image_size`` pixels across the crop, and the crop and the resize are one
bilinear (antialiased) resample, ``Image.resize(size, box=crop_box, reducing_gap=...)``.

The decoder is Pillow. Measured on 2 shared cores on generated noisy JPEGs (quality 90;
benchmarks/results/input.md): ms per image, median of interleaved rounds, ratio to Pillow's full decode;
"reduced" = the smallest DCT scale keeping ≥ 224 px:

==========  ===========  ==============  ===============  ==================  ========================
JPEG        Pillow full  Pillow reduced  simplejpeg full  simplejpeg reduced  simplejpeg full → Pillow
==========  ===========  ==============  ===============  ==================  ========================
256×256     0.33         0.33 (1.00)     0.27 (0.82)      0.47 (1.43)         0.33 (1.00)
500×375     0.76         0.75 (0.99)     0.66 (0.87)      0.87 (1.15)         0.75 (0.99)
1024×768    3.37         2.58 (0.76)     2.59 (0.77)      2.41 (0.72)         2.98 (0.88)
2048×1536   21.06        16.06 (0.76)    16.94 (0.80)     7.81 (0.37)         18.01 (0.85)
==========  ===========  ==============  ===============  ==================  ========================

simplejpeg decodes to a numpy array 13–18 % faster up to ImageNet's typical 500×375, but the crop and
resize need a Pillow image, and wrapping the array in one costs that back (0.99–1.00); it is clearly ahead
only on large JPEGs at reduced size (1.4–2× in two runs at 2048×1536). Pillow is always installed, reads
every format, and gives the same pixels on every machine; making the decoder depend on whether an optional
package is installed would make augmented samples differ between machines. This transform's validation
path on a 2048×1536 JPEG took 0.28× the time of the naive full decode, resize and crop.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from mpicrossbow.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

#: The ``augment`` values.
AUGMENTS = ("none", "standard")
#: ImageNet per-channel mean and standard deviation, pixels scaled to [0, 1].
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
#: Random-resized crop: area fraction and aspect-ratio ranges, tries before the centre-crop fallback.
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10
#: Validation: the centre crop is this fraction of the resized short side (224 of 256).
CENTRE_FRACTION = 0.875
#: A reduced-size JPEG decode keeps at least this many times the output size across the crop.
DRAFT_GAP = 2.0
#: Pillow's ``reducing_gap`` for the one resample (integer box reduction first when the factor is larger).
REDUCING_GAP = 3.0
#: x ↦ (x / 255 − mean) / std as x · scale + shift, per channel.
_SCALE = torch.tensor([1.0 / (255.0 * s) for s in STD], dtype=torch.float32).view(3, 1, 1)
_SHIFT = torch.tensor([-m / s for m, s in zip(MEAN, STD, strict=True)], dtype=torch.float32).view(3, 1, 1)
#: (left, top, right, bottom) in pixels of the image as stored.
Box = tuple[float, float, float, float]


def random_resized_crop_box(width: int, height: int) -> Box:
    """torchvision's ``RandomResizedCrop.get_params`` on a ``width``×``height`` image, from torch's RNG."""
    area = width * height
    log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    for _ in range(CROP_TRIES):
        target_area = area * torch.empty(1).uniform_(CROP_SCALE[0], CROP_SCALE[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,)).item())
            left = int(torch.randint(0, width - w + 1, size=(1,)).item())
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < CROP_RATIO[0]:
        w, h = width, round(width / CROP_RATIO[0])
    elif in_ratio > CROP_RATIO[1]:
        w, h = round(height * CROP_RATIO[1]), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def centre_crop_box(width: int, height: int, image_size: int) -> Box:
    """The part of the image that "resize the short side to round(S / 0.875), centre-crop S" keeps."""
    resized = round(image_size / CENTRE_FRACTION)
    if width <= height:
        new_w, new_h = resized, int(resized * height / width)
    else:
        new_w, new_h = int(resized * width / height), resized
    crop_w, crop_h = min(image_size, new_w), min(image_size, new_h)
    left, top = round((new_w - crop_w) / 2.0), round((new_h - crop_h) / 2.0)
    sx, sy = width / new_w, height / new_h  # stored pixels per resized pixel
    return left * sx, top * sy, (left + crop_w) * sx, (top + crop_h) * sy


class UndecodableImage(Exception):
    """Pillow could not read or decode an image; the message is Pillow's reason. The caller names the file
    (finding the name can cost a read, so it is done only when an image fails)."""


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB Pillow image as float32 (3, H, W) in [0, 1], normalised with :data:`MEAN` and :data:`STD`
    (one strided copy to float, then one multiply and one add in place)."""
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)
    out = torch.empty(pixels.shape, dtype=torch.float32)
    out.copy_(pixels)
    return out.mul_(_SCALE).add_(_SHIFT)


def crop_resize(image: Image.Image, box: Box, size: int) -> Image.Image:
    """``box`` of ``image`` resampled once to ``size``×``size`` RGB, decoding a JPEG at reduced size when
    the box is more than :data:`DRAFT_GAP` × ``size`` across at the next DCT scale."""
    width, height = image.size
    if image.format == "JPEG":
        box_w, box_h = box[2] - box[0], box[3] - box[1]
        want = (
            max(1, math.ceil(width * size * DRAFT_GAP / box_w)),
            max(1, math.ceil(height * size * DRAFT_GAP / box_h)),
        )
        drafted = image.draft("RGB", want)
        if drafted is not None:
            sx, sy = drafted[1][2] / width, drafted[1][3] / height
            box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image.resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=REDUCING_GAP)


@dataclass(frozen=True)
class ImageTransform:
    """Encoded image bytes → normalised float32 (3, S, S): ``augment`` for a training or validation split.

    Callable; picklable (DataLoader workers get a copy). A file that does not decode is a one-line
    :class:`~mpicrossbow.errors.DataError` naming it.
    """

    augment: str = "standard"
    image_size: int = 224
    train: bool = True

    def __post_init__(self) -> None:
        """Reject an unknown ``augment`` or a non-positive ``image_size`` before any image is read."""
        if self.augment not in AUGMENTS:
            raise ConfigError(
                f"[dataset] augment: expected one of {', '.join(AUGMENTS)}, got {self.augment!r}"
            )
        if self.image_size < 1:
            raise ConfigError(f"[dataset] image_size: expected a positive size, got {self.image_size}")

    def box(self, width: int, height: int) -> Box:
        """The part of a ``width``×``height`` image that becomes the output (draws from torch's RNG)."""
        if self.augment == "none":
            return 0, 0, width, height
        if self.train:
            return random_resized_crop_box(width, height)
        return centre_crop_box(width, height, self.image_size)

    def decode(self, data: bytes) -> torch.Tensor:
        """Decode ``data`` and transform it; :class:`UndecodableImage` (the reason) if it fails."""
        try:
            image = Image.open(io.BytesIO(data))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            raise UndecodableImage(str(error)) from None
        try:
            box = self.box(*image.size)
            flip = self.augment == "standard" and self.train and torch.rand(1).item() < 0.5
            out = crop_resize(image, box, self.image_size)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            raise UndecodableImage(str(error)) from None
        finally:
            image.close()
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_tensor(out)

    def __call__(self, data: bytes, name: str) -> torch.Tensor:
        """:meth:`decode`, failing as a one-line DataError naming ``name`` (the file)."""
        try:
            return self.decode(data)
        except UndecodableImage as error:
            raise DataError(f"{name}: not a decodable image ({error})") from None
