"""ImageNet ResNets (He et al. 2016) with torchvision's exact layer shapes and state_dict names.

ResNet-18 (11,689,512 parameters) and ResNet-50 (25,557,032) as plain ``nn.Module`` subclasses, so
``MODELCLASS = resnet50`` works without torchvision, and a torchvision checkpoint (``conv1``, ``bn1``,
``layer1.0.conv1`` … ``layer4.2.downsample.0``, ``fc``) loads into them with ``load_state_dict(strict=True)``,
and theirs into torchvision. As in torchvision ("ResNet v1.5") a Bottleneck puts its stride on the 3×3
convolution, not on the first 1×1; shortcuts that change shape are 1×1 convolution + BatchNorm
(``downsample.0`` / ``downsample.1``). Initialisation is torchvision's: He normal (fan out) for the
convolutions, BatchNorm weight 1 and bias 0, and optionally (``zero_init_residual``, Goyal et al. 2017) the
last BatchNorm gamma of every block 0 so each block starts as the identity.
"""

from __future__ import annotations

import torch
from torch import nn


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    """A 3×3 convolution with padding 1 and no bias (BatchNorm follows)."""
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    """A 1×1 convolution with no bias (BatchNorm follows)."""
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


def downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    """The projection shortcut where the shape changes (``Sequential(conv1x1, BN)``), else None: identity."""
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with BatchNorm, plus the shortcut, then ReLU (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample(cin, width * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))."""
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + shortcut)

    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm before the addition (``zero_init_residual`` zeroes its gamma)."""
        return self.bn2


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (with the stride: v1.5), 1×1 expand ×4, each with BatchNorm, plus the shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample(cin, width * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The three convolutions, plus the shortcut, then ReLU."""
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + shortcut)

    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm before the addition (``zero_init_residual`` zeroes its gamma)."""
        return self.bn3


class ResNet(nn.Module):
    """An ImageNet ResNet: 7×7/2 stem with max pool, four stages of ``block``, global pool, ``fc``.

    ``layers`` gives the blocks per stage (``(2, 2, 2, 2)`` for ResNet-18, ``(3, 4, 6, 3)`` for ResNet-50);
    stages 2–4 halve the resolution in their first block. Any input side of at least 32 works (global
    average pooling); 224 is ImageNet's.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int] | list[int],
        num_classes: int = 1000,
        zero_init_residual: bool = False,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or min(layers) < 1:
            raise ValueError(f"layers must be four block counts >= 1, got {list(layers)}")
        if num_classes < 1 or in_channels < 1:
            raise ValueError(f"num_classes and in_channels must be >= 1, got {num_classes}, {in_channels}")
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = 64
        for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            stride = 1 if stage == 0 else 2
            stack = [block(cin, width, stride)]
            cin = width * block.expansion
            stack += [block(cin, width) for _ in range(blocks - 1)]
            self.add_module(f"layer{stage + 1}", nn.Sequential(*stack))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)
        self.reset_parameters(zero_init_residual)

    def reset_parameters(self, zero_init_residual: bool = False) -> None:
        """torchvision's initialisation (``fc`` keeps PyTorch's default, as there)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock | Bottleneck):
                    nn.init.zeros_(m.last_bn().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(N, num_classes)`` of images ``(N, in_channels, H, W)``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000, zero_init_residual: bool = False, in_channels: int = 3) -> ResNet:
    """ResNet-18: BasicBlocks (2, 2, 2, 2), 11,689,512 parameters at 1000 classes.

    Explicit keywords rather than ``**kw``, so a cfg's ``[model]`` strings are converted by these type hints.
    """
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, zero_init_residual, in_channels)


def resnet50(num_classes: int = 1000, zero_init_residual: bool = False, in_channels: int = 3) -> ResNet:
    """ResNet-50: Bottlenecks (3, 4, 6, 3), 25,557,032 parameters at 1000 classes.

    Explicit keywords rather than ``**kw``, so a cfg's ``[model]`` strings are converted by these type hints.
    """
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, zero_init_residual, in_channels)
