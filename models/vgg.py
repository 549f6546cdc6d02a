"""VGG-16 at CIFAR width (Simonyan & Zisserman 2015, as adapted to CIFAR-10 with BatchNorm), fusable.

Thirteen 3×3 convolutions in five stages (64, 128, 256, 512, 512 channels), each followed by BatchNorm and
ReLU, a 2×2 max-pool after each stage and one linear classifier on the 512 features. Pools that would shrink
the image below 1×1 (8×8 digits) are left out. Only standard layers, so the fused engine fuses it.
"""

from __future__ import annotations

from torch import nn

from data.images import image_data, image_shape
from mpicrossbow import Shard, TorchModel

#: Output channels of each convolution; "M" is a 2×2 max-pool.
VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(TorchModel):
    """VGG-16 with BatchNorm. ``[model]`` keys: ``dataset`` (cifar10 | digits), ``root`` (CIFAR-10 folder;
    empty: synthetic), ``image_size``, ``classes``, ``width`` (channel multiplier, 1.0 = CIFAR width),
    ``dropout`` (before the classifier, 0 by default).
    """

    def __init__(
        self,
        dataset: str = "cifar10",
        root: str = "",
        image_size: int = 0,
        classes: int = 10,
        width: float = 1.0,
        dropout: float = 0.0,
    ) -> None:
        if width <= 0 or not 0.0 <= dropout < 1.0:
            raise ValueError(f"width must be > 0 and dropout in [0, 1), got {width} and {dropout}")
        self.channels, self.side, _ = image_shape(dataset, image_size)
        self.dataset, self.root, self.image_size = dataset, root, image_size
        self.classes, self.width, self.dropout = classes, width, dropout

    def module(self) -> nn.Module:
        """A fresh replica."""
        layers: list[nn.Module] = []
        cin, side = self.channels, self.side
        for item in VGG16:
            if item == "M":
                if side >= 2:
                    layers.append(nn.MaxPool2d(2))
                    side //= 2
                continue
            cout = max(1, round(int(item) * self.width))
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
            cin = cout
        head: list[nn.Module] = [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        if self.dropout:
            head.append(nn.Dropout(self.dropout))
        return nn.Sequential(*layers, *head, nn.Linear(cin, self.classes))

    def data(self, shard: Shard):
        """CIFAR-10, synthetic CIFAR-sized data or the digits."""
        return image_data(shard, self.dataset, self.root, self.image_size, self.classes)
