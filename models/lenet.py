"""LeNet-5 (LeCun et al. 1998), sized by ``image_size`` so it runs on the 8×8 digits and 28×28 MNIST alike."""

from __future__ import annotations

from torch import nn

from mpicrossbow import Shard, TorchModel


class LeNet(TorchModel):
    """conv5×5(6) → pool → conv5×5(16) → pool → 120 → 84 → classes, 'same' padding, ReLU.

    ``[model]`` keys: ``dataset`` (digits | mnist), ``root`` (MNIST folder), ``channels``, ``image_size``,
    ``classes``.
    """

    def __init__(
        self,
        dataset: str = "digits",
        root: str = "",
        channels: int = 1,
        image_size: int = 0,
        classes: int = 10,
    ) -> None:
        if dataset not in ("digits", "mnist"):
            raise ValueError(f"dataset must be digits or mnist, got {dataset!r}")
        self.dataset, self.root, self.channels, self.classes = dataset, root, channels, classes
        self.image_size = image_size or (8 if dataset == "digits" else 28)

    def module(self) -> nn.Module:
        """A fresh replica."""
        side = self.image_size // 4
        return nn.Sequential(
            nn.Conv2d(self.channels, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * side * side, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, self.classes),
        )  # fmt: skip

    def data(self, shard: Shard):
        """This rank's share of the digits or of MNIST."""
        if self.dataset == "mnist":
            from data.idx import MNIST

            return MNIST(shard, self.root)
        from data.digits import Digits

        return Digits(shard)
