"""Data sets by name: ``[data] dataset = NAME`` with the data set's keyword arguments in ``[dataset]``.

A name is a built-in (the table :data:`BUILTIN`) or ``package.module:callable`` for your own. Either way the
factory is called once per split, ``factory(split, **[dataset])`` with ``split`` in ``{"train", "val"}``, and
returns a map-style ``torch.utils.data.Dataset`` of ``(input, target)`` pairs. ``[dataset]`` values are
converted to the types the factory annotates; image data sets also receive ``[data]``'s ``augment``,
``image_size`` and ``on_bad_sample`` when their factory takes those keywords. An unknown name is one
ConfigError listing the valid ones; a factory that fails or returns something else is one DataError.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ..config.fields import call_kwargs
from ..config.sections import DataSection
from ..errors import ConfigError, ContractError, DataError, UsageError
from ..model.contract import search_working_directory

#: Built-in name → ``module:callable`` (imported when used; ``data.*`` is the repository's readers package).
BUILTIN: dict[str, str] = {
    "digits": "data.digits:digits_dataset",
    "mnist1d": "mpicrossbow.data.mnist1d:mnist1d",
    "mnist": "data.idx:mnist_dataset",
    "cifar10": "data.cifar:cifar10_dataset",
    "imagefolder": "mpicrossbow.data.images:ImageFolder",
    "shards": "mpicrossbow.data.shards:Shards",
}
#: ``[data]`` keys handed to a factory that takes a keyword of the same name.
IMAGE_OPTIONS = ("augment", "image_size", "on_bad_sample")
SPLITS = ("train", "val")


def dataset_factory(name: str) -> Callable[..., Any]:
    """The factory ``name`` stands for: a built-in or ``package.module:callable``."""
    spec = BUILTIN.get(name.strip().lower(), name.strip())
    if ":" not in spec:
        valid = ", ".join(BUILTIN)
        raise ConfigError(
            f"[data] dataset: unknown data set '{name}'; valid: {valid}, or package.module:callable"
        )
    module_name, _, attr = spec.partition(":")
    search_working_directory()  # as for MODELFILE
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        where = " (the built-in readers live in the repository's data/ package: run from its root)"
        hint = where if module_name.startswith("data.") else ""
        raise ConfigError(f"[data] dataset '{name}': cannot import {module_name}: {exc}{hint}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"[data] dataset '{name}': {module_name} has no callable '{attr}'")
    return factory


def build_dataset(name: str, split: str, params: Mapping[str, Any], data: DataSection) -> Any:
    """``split`` of data set ``name`` built with ``params`` (``[dataset]``); checked to be a map-style set."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    factory = dataset_factory(name)
    kwargs = call_kwargs(factory, params, "dataset")
    if "split" in kwargs:
        raise ConfigError("[dataset] split: the framework builds both splits (train, val); remove the key")
    accepted = inspect.signature(factory).parameters
    for option in IMAGE_OPTIONS:
        if option in accepted and option not in kwargs:
            kwargs[option] = getattr(data, option)
    try:
        by_name = "split" in accepted and next(iter(accepted)) != "split"  # e.g. ImageFolder(root, split)
        dataset = factory(split=split, **kwargs) if by_name else factory(split, **kwargs)
    except UsageError:
        raise
    except ImportError as exc:
        raise DataError(
            f"[data] dataset '{name}' needs the package '{exc.name}', which is not installed "
            f"(pip install {exc.name})"
        ) from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise DataError(f"[data] dataset '{name}' ({split}): {type(exc).__name__}: {exc}") from None
    check_map_style(dataset, name, split)
    return dataset


def check_map_style(dataset: Any, name: str, split: str) -> None:
    """A map-style data set has ``__getitem__`` and ``__len__``, and a training split is not empty."""
    if not (callable(getattr(dataset, "__getitem__", None)) and callable(getattr(dataset, "__len__", None))):
        raise ContractError(
            f"[data] dataset '{name}' returned {type(dataset).__name__} for split '{split}', not a map-style "
            "torch.utils.data.Dataset (one with __getitem__ and __len__)"
        )
    if split == "train" and len(dataset) == 0:
        raise DataError(f"[data] dataset '{name}': the training split is empty")


def labels_of(dataset: Any) -> Any:
    """The data set's labels without loading its samples (``targets`` or ``labels``), or None."""
    for attr in ("targets", "labels"):
        value = getattr(dataset, attr, None)
        if value is not None:
            return value
    return None
