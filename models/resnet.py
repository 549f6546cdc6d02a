"""CIFAR-style ResNets (He et al. 2016, section 4.2): ResNet-20 and ResNet-32, written to be fusable.

Three stages of 16, 32 and 64 channels with n basic blocks each (depth = 6n + 2), BatchNorm after every
convolution, 1×1-convolution + BatchNorm shortcuts where the shape changes (option B), global average
pooling and one linear layer. Each block is ``Sequential(Residual(body, shortcut), ReLU())`` built from
standard layers, so the fused engine fuses it mechanically (mpicrossbow/pool/fused_network.py).
"""

from __future__ import annotations

from torch import nn

from data.images import image_data, image_shape
from mpicrossbow import Shard, TorchModel
from mpicrossbow.model.residual import Residual


def basic_block(cin: int, cout: int, stride: int) -> nn.Module:
    """conv3×3 → BN → ReLU → conv3×3 → BN, plus the shortcut, then ReLU."""
    body = nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
    )  # fmt: skip
    shortcut: nn.Module = nn.Identity()
    if stride != 1 or cin != cout:
        shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
    return nn.Sequential(Residual(body, shortcut), nn.ReLU())


class ResNet(TorchModel):
    """A CIFAR ResNet of ``depth`` = 6n + 2 layers.

    ``[model]`` keys: ``depth`` (20, 32, 44, …), ``dataset`` (cifar10 | digits), ``root`` (CIFAR-10
    ``cifar-10-batches-bin`` folder; empty: synthetic CIFAR-sized data), ``image_size`` (synthetic side,
    default 32), ``classes``, ``width`` (channels of the first stage, 16 in the paper).
    """

    def __init__(
        self,
        depth: int = 20,
        dataset: str = "cifar10",
        root: str = "",
        image_size: int = 0,
        classes: int = 10,
        width: int = 16,
    ) -> None:
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"depth must be 6n + 2 with n >= 1, got {depth}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.channels, _, _ = image_shape(dataset, image_size)
        self.depth, self.dataset, self.root, self.image_size = depth, dataset, root, image_size
        self.classes, self.width = classes, width

    def module(self) -> nn.Module:
        """A fresh replica, convolutions initialised as in the paper (He normal, fan out)."""
        n, w = (self.depth - 2) // 6, self.width
        layers: list[nn.Module] = [
            nn.Conv2d(self.channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
        ]  # fmt: skip
        cin = w
        for stage, cout in enumerate((w, 2 * w, 4 * w)):
            for b in range(n):
                layers.append(basic_block(cin, cout, 2 if stage > 0 and b == 0 else 1))
                cin = cout
        net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, self.classes))
        for layer in net.modules():
            if isinstance(layer, nn.Conv2d):
                nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
        return net

    def data(self, shard: Shard):
        """CIFAR-10, synthetic CIFAR-sized data or the digits (see the class docstring)."""
        return image_data(shard, self.dataset, self.root, self.image_size, self.classes)


class ResNet20(ResNet):
    """ResNet-20 (n = 3): 0.27 M parameters at width 16; the keys of :class:`ResNet` but depth."""

    def __init__(
        self,
        dataset: str = "cifar10",
        root: str = "",
        image_size: int = 0,
        classes: int = 10,
        width: int = 16,
    ) -> None:
        super().__init__(20, dataset, root, image_size, classes, width)


class ResNet32(ResNet):
    """ResNet-32 (n = 5): 0.46 M parameters at width 16; the keys of :class:`ResNet` but depth."""

    def __init__(
        self,
        dataset: str = "cifar10",
        root: str = "",
        image_size: int = 0,
        classes: int = 10,
        width: int = 16,
    ) -> None:
        super().__init__(32, dataset, root, image_size, classes, width)
