"""Theano-MPI's CIFAR-10 example model, ported to PyTorch in Theano-MPI's own model-file form.

The network follows Theano-MPI's ``Cifar10_model``: three 5×5 convolutions without padding, the first two
each followed by a 2×2 max-pool (32 → 28 → 14 → 10 → 5 → 1), a 256-unit fully connected layer with dropout
0.5, and a 10-way classifier; SGD with momentum 0.9 and weight decay 1e-4, the rate divided by 10 at 50, 60
and 65 of 70 epochs (scaled to ``n_epochs``). As in Theano-MPI the class receives the launcher's ``config``
dict, owns its optimizer and data, updates itself in ``train_iter`` and reports cost and error through the
recorder; the rule exchanges ``params``.

Data: CIFAR-10's binary batches from ``[model] root`` (a ``cifar-10-batches-bin`` folder you have), else a
learnable synthetic stand-in of the same shape (no download here: each class a fixed random image plus
noise), so the example runs anywhere. ``launch/theano_cifar10.cfg`` trains it, written in Theano-MPI's cfg
dialect.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from data.cifar import CIFAR10
from data.synthetic import Synthetic
from models.legacy_mlp import LegacyMLP
from models.theano_data import BatchesByCount
from mpicrossbow import Shard

#: Epochs (of 70) after which the rate falls tenfold, as in Theano-MPI's schedule.
STEPS_OF_70 = (50, 60, 65)


def network(classes: int = 10) -> nn.Module:
    """The convolutional network of Theano-MPI's CIFAR-10 model."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(128, 64, 5),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(256, classes),
    )


class Cifar10_model(LegacyMLP):  # Theano-MPI's class name, so its cfgs name it unchanged
    """ModelClass in Theano-MPI's form (see the module doc): LegacyMLP's ``train_iter``, ``val_iter`` and
    ``cleanup`` on this network, optimizer, data and schedule."""

    def __init__(self, config: dict[str, Any]) -> None:  # its own network and data: no super().__init__
        self.config = config
        self.verbose = config["verbose"]
        self.base_lr = float(config.get("lr", 0.01))
        self.n_epochs = int(config.get("n_epochs", 70))
        shard = Shard(config["rank"], config["size"], int(config.get("batch_size", 64)), config["seed"])
        root = config.get("root", "")
        arrays = CIFAR10(shard, root) if root else Synthetic(shard, n_train=2048, n_val=512, seed=7)
        self.data = BatchesByCount(arrays)
        torch.manual_seed(int(config["seed"]))  # the same initial weights on every rank
        self.net = network()
        self.params = list(self.net.parameters())
        self.optimizer: torch.optim.Optimizer | None = None

    def compile_iter_fns(self, sync_type: str = "avg") -> None:
        """Theano-MPI compiled its Theano functions here; the optimizer is built instead."""
        self.optimizer = torch.optim.SGD(self.params, lr=self.base_lr, momentum=0.9, weight_decay=1e-4)

    def adjust_hyperp(self, epoch: int) -> None:
        """The step schedule: the base rate divided by 10 at each of 50, 60 and 65 seventieths of the run."""
        assert self.optimizer is not None
        drops = sum(epoch >= round(step * self.n_epochs / 70) for step in STEPS_OF_70)
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * 0.1**drops
