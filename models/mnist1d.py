"""The MNIST-1D models of Greydanus 2020 ("Scaling down deep learning"), as plain ``nn.Module`` subclasses.

MNIST-1D (``mpicrossbow.data.mnist1d``) is a 40-point signal per sample, 10 classes. The paper's two small
baselines: a CNN of three strided 1-D convolutions and a linear classifier (5,210 parameters, ~94 % in the
paper) and a 3-layer MLP whose middle layer is residual (15,210 parameters, ~68 %). Both take ``(N, 40)``
or ``(N, 1, 40)`` float input and return ``(N, num_classes)`` logits.
"""

from __future__ import annotations

import torch
from torch import nn


def as_signal(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` as ``(N, length)``: accepts ``(N, length)`` and ``(N, 1, length)``; anything else is an error."""
    if x.dim() == 3 and x.shape[1] == 1:
        x = x[:, 0]
    if x.dim() != 2 or x.shape[1] != length:
        raise ValueError(f"expected input (N, {length}) or (N, 1, {length}), got {tuple(x.shape)}")
    return x


def conv_length(length: int, kernel: int, stride: int, padding: int) -> int:
    """Output length of a 1-D convolution (PyTorch's formula, dilation 1)."""
    return (length + 2 * padding - kernel) // stride + 1


class MNIST1DCNN(nn.Module):
    """The paper's ConvBase: three ReLU'd ``Conv1d`` (kernels 5, 3, 3; stride 2; padding 1), flatten, linear.

    With the defaults the signal shrinks 40 → 19 → 10 → 5, so the classifier sees 25 × 5 = 125 features.
    ``length`` is the signal length (40 in MNIST-1D); ``channels`` the width of every convolution.
    """

    def __init__(self, num_classes: int = 10, channels: int = 25, length: int = 40) -> None:
        super().__init__()
        if num_classes < 1 or channels < 1 or length < 8:
            raise ValueError(
                f"need num_classes, channels >= 1 and length >= 8, got {num_classes}, {channels}, {length}"
            )
        self.length = length
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        out = conv_length(conv_length(conv_length(length, 5, 2, 1), 3, 2, 1), 3, 2, 1)
        self.relu = nn.ReLU()
        self.linear = nn.Linear(channels * out, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of signals ``(N, length)`` or ``(N, 1, length)``."""
        h = as_signal(x, self.length).unsqueeze(1)
        h = self.relu(self.conv3(self.relu(self.conv2(self.relu(self.conv1(h))))))
        return self.linear(h.flatten(1))


class MNIST1DMLP(nn.Module):
    """The paper's MLPBase: ``h = relu(W1 x)``, ``h = h + relu(W2 h)``, logits ``W3 h``; ``hidden`` = 100.

    The residual middle layer is the paper's; ``inputs`` is the signal length (40 in MNIST-1D).
    """

    def __init__(self, num_classes: int = 10, hidden: int = 100, inputs: int = 40) -> None:
        super().__init__()
        if num_classes < 1 or hidden < 1 or inputs < 1:
            raise ValueError(f"need num_classes, hidden, inputs >= 1, got {num_classes}, {hidden}, {inputs}")
        self.inputs = inputs
        self.linear1 = nn.Linear(inputs, hidden)
        self.linear2 = nn.Linear(hidden, hidden)
        self.linear3 = nn.Linear(hidden, num_classes)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of signals ``(N, inputs)`` or ``(N, 1, inputs)``."""
        h = self.relu(self.linear1(as_signal(x, self.inputs)))
        h = h + self.relu(self.linear2(h))
        return self.linear3(h)
