"""An MLP on the digits written in Theano-MPI's model-file form (``params``, ``data``, ``train_iter`` ...).

It shows that a model ported from Theano-MPI keeps its shape: the class gets a ``config`` dict, owns its
optimizer, updates itself in ``train_iter``, and exposes ``params`` for the rule to exchange (BSP then
averages parameters, Theano-MPI's ``avg``). Parameters must be updated in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from data.digits import Digits
from models.theano_data import BatchesByCount
from mpicrossbow import Shard


class LegacyMLP:
    """ModelClass in Theano-MPI's form."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.verbose = config["verbose"]
        self.base_lr = float(config.get("lr", 0.1))
        shard = Shard(config["rank"], config["size"], int(config.get("batch_size", 32)), config["seed"])
        self.data = BatchesByCount(Digits(shard))
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.params = list(self.net.parameters())
        self.optimizer: torch.optim.Optimizer | None = None

    def compile_iter_fns(self, sync_type: str = "avg") -> None:
        """Theano-MPI compiled its functions here; we build the optimizer."""
        self.optimizer = torch.optim.SGD(self.params, lr=self.base_lr, momentum=0.9)

    def _cost_error(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, float]:
        x, y = batch
        out = self.net(x)
        return nn.functional.cross_entropy(out, y), float((out.argmax(1) != y).float().mean())

    def train_iter(self, count: int, recorder: Any) -> None:
        """One training step on batch ``count``, including the update."""
        assert self.optimizer is not None, "compile_iter_fns() first"
        recorder.start()
        self.net.train()
        cost, error = self._cost_error(self.data.train_batch(count))
        self.optimizer.zero_grad()
        cost.backward()
        self.optimizer.step()
        recorder.train_error(count, float(cost.detach()), error)
        recorder.end("calc")

    def val_iter(self, count: int, recorder: Any) -> None:
        """Evaluate validation batch ``count``."""
        self.net.eval()
        with torch.no_grad():
            cost, error = self._cost_error(self.data.val_batch(count))
        recorder.val_error(count, float(cost), error)

    def adjust_hyperp(self, epoch: int) -> None:
        """Step decay: the learning rate falls tenfold after 75 % of the epochs."""
        assert self.optimizer is not None
        lr = self.base_lr * (0.1 if epoch >= 0.75 * self.config["n_epochs"] else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def cleanup(self) -> None:
        """Nothing to release."""
