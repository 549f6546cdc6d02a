"""A user's data-set factories: ``factory(split, **[dataset])`` returning a map-style Dataset."""

from __future__ import annotations

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from data.digits import DEFAULT_PATH


class NoisyDigits(Dataset):
    """The digits with random noise added to every sample when it is read (augmentation drawn from torch's
    global generator, as torchvision-style transforms do); the validation split is noise-free."""

    def __init__(self, split: str, noise: float = 0.1, label_offset: int = 0) -> None:
        with h5py.File(DEFAULT_PATH, "r") as f:
            x, y = f["x"][()], f["y"][()]
            scale = float(f.attrs["scale"])
        rows = np.arange(len(y))
        rows = rows[rows % 5 != 0] if split == "train" else rows[rows % 5 == 0]
        self.x = torch.from_numpy(x[rows].astype(np.float32) / scale)
        self.targets = torch.from_numpy(y[rows].astype(np.int64)) + label_offset
        self.noise = noise if split == "train" else 0.0

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index]
        if self.noise:
            x = x + self.noise * torch.randn_like(x)
        return x, self.targets[index]


def noisy_digits(split: str, noise: float = 0.1, label_offset: int = 0) -> NoisyDigits:
    """The factory the cfg names: ``[data] dataset = user_project.datasets:noisy_digits``."""
    return NoisyDigits(split, noise, label_offset)


def not_a_dataset(split: str, noise: float = 0.0) -> list[int]:
    """A factory that returns something else than a Dataset (a bad-input test)."""
    return 5  # type: ignore[return-value]


def broken(split: str, root: str = "nowhere") -> NoisyDigits:
    """A factory whose files are missing."""
    raise FileNotFoundError(f"[Errno 2] No such file or directory: '{root}'")
