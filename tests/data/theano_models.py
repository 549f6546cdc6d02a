"""Theano-MPI-form models that report less than LegacyMLP, for the recorder tests: what a model does not
report must show as not reported (NaN in metrics.h5, ``n/a`` in the log), never as 0."""

from __future__ import annotations

from typing import Any

import torch

from models.legacy_mlp import LegacyMLP


class ReturnsCost(LegacyMLP):
    """Trains like LegacyMLP but returns its training cost from ``train_iter`` instead of calling the
    recorder, and reports no error rate at all: accuracy is never measured, the loss is."""

    def train_iter(self, count: int, recorder: Any) -> float:
        """One step; the batch's cost is the return value."""
        assert self.optimizer is not None
        self.net.train()
        cost, _ = self._cost_error(self.data.train_batch(count))
        self.optimizer.zero_grad()
        cost.backward()
        self.optimizer.step()
        return float(cost.detach())

    def val_iter(self, count: int, recorder: Any) -> None:
        """Validates nothing it reports."""
        with torch.no_grad():
            self._cost_error(self.data.val_batch(count))
