"""A user's network: a plain ``torch.nn.Module`` and a function returning one, nothing of mpicrossbow."""

from __future__ import annotations

from torch import nn


class DigitsNet(nn.Module):
    """A two-layer perceptron for the 8×8 digits."""

    def __init__(self, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):  # as users write it: no type hints
        """Class scores."""
        return self.body(x)


def digits_net(hidden: int = 64, classes: int = 10) -> nn.Module:
    """The same network from a function, as ``torchvision.models.resnet50`` is one."""
    return DigitsNet(hidden, classes)


def not_a_network(hidden: int = 64) -> object:
    """A callable MODELCLASS that returns something else (a bad-input test)."""
    return {"hidden": hidden}
