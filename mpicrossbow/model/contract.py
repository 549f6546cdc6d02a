"""The model contract: how a model file tells mpicrossbow what to train, in one of three forms.

**A plain network.** ``MODELCLASS`` is a ``torch.nn.Module`` subclass, or any callable returning one
(``MODELFILE=torchvision.models``, ``MODELCLASS=resnet50``), built with the ``[model]`` keys as keyword
arguments; the data comes from ``[data] dataset`` (see :mod:`mpicrossbow.data.dataset_model`).

**Torch-native**. ``MODELCLASS`` is a class whose keyword arguments come from ``[model]`` and which
has

* ``module() -> nn.Module`` — build one fresh replica (the framework makes one per learner);
* ``data(shard) -> DataClass`` — this rank's data; ``shard`` is a :class:`~mpicrossbow.shard.Shard`;
* optional ``loss(output, target)`` (default cross-entropy), ``optimizer(params, optim)`` (default SGD from
  ``[optim]``) and ``correct(output, target)`` (default top-1 hits).

Subclassing :class:`TorchModel` gives the defaults, but any class with these members works.

**Theano-MPI form** (compatibility). ``MODELCLASS(config)`` receives a dict (rank, size, device, seed,
batch_size, lr, verbose and the ``[model]`` keys) and has ``params`` (a list of tensors the rule exchanges),
``data`` (with ``n_batch_train`` and ``n_batch_val``), ``compile_iter_fns()``, ``train_iter(count, recorder)``
(one step including its own update), ``val_iter(count, recorder)``, ``adjust_hyperp(epoch)`` and
``cleanup()``.

A DataClass has ``n_batch_train`` and ``n_batch_val`` and, in the torch-native form, ``train_batches(epoch)``
and ``val_batches()`` iterators of ``(inputs, targets)``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..config import OptimSection
from ..errors import ContractError
from .shard import Shard

TORCH_MEMBERS = ("module", "data")
THEANO_METHODS = ("compile_iter_fns", "train_iter", "val_iter", "adjust_hyperp", "cleanup")
THEANO_ATTRIBUTES = ("params", "data")
DATA_ATTRIBUTES = ("n_batch_train", "n_batch_val")


class TorchModel:
    """Optional base class of a torch-native model file: override ``module`` and ``data``."""

    def module(self) -> nn.Module:
        """Build one new replica of the network."""
        raise NotImplementedError

    def data(self, shard: Shard) -> Any:
        """This rank's DataClass (``n_batch_train``, ``n_batch_val``, ``train_batches``, ``val_batches``)."""
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch; cross-entropy by default."""
        return F.cross_entropy(output, target)

    def optimizer(self, params: Any, optim: OptimSection) -> torch.optim.Optimizer:
        """The local optimizer of one replica; SGD with ``[optim]``'s lr, momentum and weight decay."""
        return torch.optim.SGD(params, **sgd_settings(optim))

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | int:
        """Number of top-1 hits in a batch (a 0-dim tensor avoids a device sync per step)."""
        return (output.argmax(dim=1) == target).sum()


def sgd_settings(optim: OptimSection) -> dict[str, Any]:
    """The default recipe's ``torch.optim.SGD`` keywords from ``[optim]`` (every engine builds it alike)."""
    return {
        "lr": optim.lr,
        "momentum": optim.momentum,
        "weight_decay": optim.weight_decay,
        "nesterov": optim.nesterov,
    }


def search_working_directory() -> None:
    """Put the working directory on ``sys.path``: Theano-MPI's convention, a user's modules (model files,
    data-set factories) are found from where the job runs."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def _import_module(modelfile: str) -> Any:
    """Import MODELFILE given as a dotted module (``models.lenet``, from the working directory) or a path."""
    search_working_directory()
    if modelfile.endswith(".py") or os.sep in modelfile:
        path = Path(modelfile)
        if not path.is_file():
            raise ContractError(f"MODELFILE '{modelfile}': no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(modelfile)
    except ModuleNotFoundError as exc:
        if exc.name and modelfile.startswith(exc.name):
            raise ContractError(
                f"MODELFILE '{modelfile}': module not found (run from the folder that holds it, "
                f"or give a path to a .py file); working directory: {os.getcwd()}"
            ) from None
        raise


def raised_at(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc`` in the user's code (importlib's own frozen frames left
    out), relative to the working directory when under it: where a model file that raises at import failed,
    so the one line names the file and line and the user need not find a traceback."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith("<frozen") or frame.filename == __file__:
            continue
        path = Path(frame.filename)
        with contextlib.suppress(ValueError):
            path = path.resolve().relative_to(Path.cwd().resolve())
        return f"{path}:{frame.lineno}"
    return "an unknown line"


def load_model_class(modelfile: str, modelclass: str) -> Any:
    """MODELCLASS (a class or a function) from MODELFILE; an import failure is one ContractError line."""
    try:
        module = _import_module(modelfile)
    except ContractError:
        raise
    except ModuleNotFoundError as exc:
        raise ContractError(f"MODELFILE '{modelfile}' imports '{exc.name}', which is not installed") from None
    except SyntaxError as exc:
        raise ContractError(
            f"MODELFILE '{modelfile}': syntax error in {exc.filename} line {exc.lineno}: {exc.msg}"
        ) from None
    except Exception as exc:
        raise ContractError(
            f"MODELFILE '{modelfile}' failed to import at {raised_at(exc)}: {type(exc).__name__}: {exc}"
        ) from None
    cls = getattr(module, modelclass, None)
    if not callable(cls):
        found = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and getattr(v, "__module__", None) == module.__name__ and not n.startswith("_")
        )
        raise ContractError(
            f"MODELCLASS '{modelclass}' not found in {modelfile}; "
            f"classes and functions there: {', '.join(found) or '(none)'}"
        )
    return cls


def contract_form(cls: Any) -> Literal["torch", "theano", "module"]:
    """Which contract ``cls`` follows; ContractError names what is missing when it follows none fully.

    ``module``: an ``nn.Module`` subclass or a function (anything callable that is not a class), whose
    result is checked to be an ``nn.Module`` when the first replica is built.
    """
    if not isinstance(cls, type) or issubclass(cls, nn.Module):
        return "module"
    if any(hasattr(cls, m) for m in ("train_iter", "compile_iter_fns")):
        missing = [m for m in THEANO_METHODS if not callable(getattr(cls, m, None))]
        if missing:
            raise ContractError(
                f"{cls.__name__} (Theano-MPI form) is missing method(s): {', '.join(missing)}"
            )
        return "theano"
    missing = [m for m in TORCH_MEMBERS if not callable(getattr(cls, m, None))]
    if missing:
        raise ContractError(
            f"{cls.__name__} is missing {', '.join(m + '()' for m in missing)}; a torch-native model needs "
            f"module() and data(shard); a Theano-MPI-form model needs {', '.join(THEANO_METHODS)}; "
            "or name a torch.nn.Module subclass (or a function returning one) and set [data] dataset"
        )
    for m in TORCH_MEMBERS:
        if getattr(cls, m) is getattr(TorchModel, m):
            raise ContractError(f"{cls.__name__} must override {m}() of TorchModel")
    return "torch"


def check_data(data: Any, owner: str, torch_form: bool) -> None:
    """Check a DataClass instance: batch counts as non-negative ints, and the iterators in torch form."""
    for attr in DATA_ATTRIBUTES:
        value = getattr(data, attr, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ContractError(f"{owner}: data.{attr} must be a non-negative int, got {value!r}")
    if torch_form:
        for method in ("train_batches", "val_batches"):
            if not callable(getattr(data, method, None)):
                raise ContractError(f"{owner}: data has no {method}() method")
