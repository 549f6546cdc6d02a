"""A plain ``nn.Module`` (or a function returning one) trained on a data set named in the cfg.

The torch-native contract asks a model file for ``module()`` and ``data(shard)``. Most people already have a
network class (or ``torchvision.models.resnet50``) and a ``torch.utils.data.Dataset``: :class:`DatasetModel`
makes the first into ``module()`` — called with the ``[model]`` keys — and the second, built once per rank by
the registry (:mod:`mpicrossbow.data.registry`), into ``data(shard)``: a
:class:`~mpicrossbow.data.loader.LoaderData` of the learner's part. Loss, optimizer and hits are
:class:`~mpicrossbow.model.contract.TorchModel`'s defaults (cross-entropy, SGD from ``[optim]``, top-1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ContractError, DataError
from ..model.contract import TorchModel
from ..model.shard import Shard
from .loader import LoaderData, LoaderOptions
from .registry import labels_of


class DatasetModel(TorchModel):
    """``factory(**kwargs)`` as the replica, ``train_set`` / ``val_set`` as the data."""

    def __init__(
        self,
        factory: Callable[..., Any],
        kwargs: Mapping[str, Any],
        train_set: Any,
        val_set: Any,
        options: LoaderOptions,
    ) -> None:
        self.factory, self.kwargs = factory, dict(kwargs)
        self.name = getattr(factory, "__name__", type(factory).__name__)
        self.train_set, self.val_set, self.options = train_set, val_set, options

    def module(self) -> nn.Module:
        """One new replica: ``factory(**[model])``, checked to be an ``nn.Module``."""
        try:
            module = self.factory(**self.kwargs)
        except TypeError as exc:
            raise ContractError(f"{self.name}(...) could not be constructed: {exc}") from None
        if not isinstance(module, nn.Module):
            raise ContractError(
                f"MODELCLASS {self.name} returned {type(module).__name__}, not a torch.nn.Module"
            )
        return module

    def data(self, shard: Shard) -> LoaderData:
        """The learner's part of the two data sets, through a DataLoader."""
        return LoaderData(self.train_set, self.val_set, shard, self.options)


def check_labels(module: nn.Module, train_set: Any, source: str, device: torch.device) -> int:
    """Before training: the model's outputs cover every label of the data set; the number of outputs.

    One sample goes through the network (eval mode, no gradients) to count its outputs; the labels are the
    data set's ``targets`` when it has them, else the first sample's. A label out of range is a DataError.
    """
    inputs, target = train_set[0]
    if not isinstance(inputs, torch.Tensor):
        raise DataError(f"{source}: a sample's input is a {type(inputs).__name__}, not a torch.Tensor")
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            output = module(inputs.unsqueeze(0).to(device))
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise DataError(
            f"{source}: the model cannot take a sample of shape {tuple(inputs.shape)}: {first}"
        ) from None
    finally:
        module.train(was_training)
    if output.ndim != 2:
        return -1  # not a classifier's (1, classes): nothing to check against
    classes = int(output.shape[1])
    labels = labels_of(train_set)
    labels = torch.as_tensor(labels if labels is not None else [int(target)])
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        bad = high if high >= classes else low
        raise DataError(
            f"{source}: label {bad} is out of range for the model's {classes} outputs (labels must be "
            f"0..{classes - 1}); set the model's number of classes in [model] (e.g. num_classes = {high + 1})"
        )
    return classes
