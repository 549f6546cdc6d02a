"""A multi-layer perceptron on the bundled 8×8 digits: the default job's model (torch-native contract)."""

from __future__ import annotations

import itertools

from torch import nn

from data.digits import Digits
from mpicrossbow import Shard, TorchModel


class MLP(TorchModel):
    """Flatten → (Linear → ReLU) × layers → Linear. ``[model]`` keys: hidden, layers, classes, inputs."""

    def __init__(self, hidden: int = 128, layers: int = 2, classes: int = 10, inputs: int = 64) -> None:
        if hidden < 1 or layers < 1:
            raise ValueError("hidden and layers must be >= 1")
        self.hidden, self.layers, self.classes, self.inputs = hidden, layers, classes, inputs

    def module(self) -> nn.Module:
        """A fresh replica."""
        widths = [self.inputs] + [self.hidden] * self.layers
        body: list[nn.Module] = [nn.Flatten()]
        for a, b in itertools.pairwise(widths):
            body += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*body, nn.Linear(widths[-1], self.classes))

    def data(self, shard: Shard) -> Digits:
        """This rank's share of the digits."""
        return Digits(shard)
