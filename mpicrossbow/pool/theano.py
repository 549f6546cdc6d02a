"""Adapter that runs a Theano-MPI-form model (``train_iter``/``val_iter``/``params``) as a learner pool."""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError, ContractError
from ..model.contract import check_data
from .base import LearnerPool
from .flat import flatten_into_buffer


class TheanoRecorder:
    """Theano-MPI's recorder: the model reports per-batch cost and error through it.

    ``train`` and ``val`` hold (cost sum, accuracy sum, batches reported). A batch reported without an error
    rate (a ``train_iter`` that returns only its cost) makes the accuracy sum NaN: not reported, which the
    log and metrics.h5 show as such, never as 0.
    """

    def __init__(self) -> None:
        self.train = [0.0, 0.0, 0.0]  # cost sum, accuracy sum, batches
        self.val = [0.0, 0.0, 0.0]
        self.times: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def start(self) -> None:
        """Start timing a phase."""
        self._t0 = time.perf_counter()

    def end(self, phase: str) -> None:
        """Stop timing ``phase`` ('calc', 'comm', ...) and add it up."""
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - self._t0

    def train_error(self, count: int, cost: float, error: float | None = None) -> None:
        """Record one training batch: mean cost and error rate (0..1; None: not reported)."""
        self.train = added(self.train, cost, error)

    def val_error(
        self, count: int, cost: float, error: float | None = None, error_top_5: float | None = None
    ) -> None:
        """Record one validation batch: mean cost and error rate (0..1; None: not reported)."""
        self.val = added(self.val, cost, error)

    def returned(self, table: str, before: float, result: Any, count: int) -> None:
        """What ``train_iter``/``val_iter`` returned — a cost, or ``(cost, error)`` — recorded as a batch when
        the call reported nothing itself (``before``: the batches reported before the call)."""
        if result is None or getattr(self, table)[2] != before:
            return
        cost, error = result if isinstance(result, (tuple, list)) else (result, None)
        (self.train_error if table == "train" else self.val_error)(count, cost, error)


def added(row: list[float], cost: float, error: float | None) -> list[float]:
    """``row`` (cost sum, accuracy sum, batches) with one batch more."""
    accuracy = math.nan if error is None else 1.0 - float(error)
    return [row[0] + float(cost), row[1] + accuracy, row[2] + 1.0]


class _ParamsOnly:
    """The learner face of a Theano-MPI-form model: flat params, no gradients or buffers."""

    def __init__(self, params: torch.Tensor) -> None:
        self.params = params
        self.grads = torch.zeros(0)
        self.buffers = torch.zeros(0)


class TheanoPool(LearnerPool):
    """One Theano-MPI-form model per rank. Stats are per batch (cost, error rate), as Theano-MPI reports."""

    has_gradients = False

    def __init__(self, model: Any) -> None:
        self.model = model
        owner = type(model).__name__
        params = getattr(model, "params", None)
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in params):
            raise ContractError(f"{owner}.params must be a list of torch tensors")
        if not params:
            raise ContractError(f"{owner}.params is empty: nothing to exchange")
        check_data(getattr(model, "data", None), owner, torch_form=False)
        # The tensors keep their identity (the model's optimizer still holds them); their storage moves
        # into one flat buffer, so train_iter must update them in place.
        flat = flatten_into_buffer(list(params))
        self.learners = [_ParamsOnly(flat)]  # type: ignore[list-item]
        self.recorder = TheanoRecorder()
        self._epoch = -1
        compile_fns = model.compile_iter_fns
        if "sync_type" in inspect.signature(compile_fns).parameters:
            compile_fns(sync_type="avg")
        else:
            compile_fns()

    @property
    def n_batch_train(self) -> int:
        """The model's ``data.n_batch_train``."""
        return int(self.model.data.n_batch_train)

    def start_epoch(self, epoch: int) -> None:
        """Nothing to prepare: the model reads its own data."""

    def compute(self, count: int) -> None:
        """One ``train_iter`` (forward, backward and the model's own update); a cost it returns counts when it
        reported nothing to the recorder."""
        before = self.recorder.train[2]
        self.recorder.returned("train", before, self.model.train_iter(count, self.recorder), count)

    def apply(self) -> None:
        """Nothing: ``train_iter`` already updated the weights."""

    def set_lr(self, lr: float, epoch: int) -> None:
        """Theano-MPI models own their schedule: call ``adjust_hyperp(epoch)`` once per epoch."""
        if epoch != self._epoch:
            self._epoch = epoch
            self.model.adjust_hyperp(epoch)

    def take_stats(self) -> tuple[float, float, float]:
        """(cost sum, accuracy sum, batches) since the last call."""
        out = tuple(self.recorder.train)
        self.recorder.train = [0.0, 0.0, 0.0]
        return out  # type: ignore[return-value]

    def validate(self, params: torch.Tensor | None = None, data: Any = None) -> tuple[float, float, float]:
        """Run ``val_iter`` over ``data.n_batch_val`` batches; weights swapped in from ``params`` if given."""
        flat = self.learners[0].params
        saved = flat.clone() if params is not None else None
        if params is not None:
            flat.copy_(params)
        self.recorder.val = [0.0, 0.0, 0.0]
        try:
            for count in range(int(self.model.data.n_batch_val)):
                before = self.recorder.val[2]
                self.recorder.returned("val", before, self.model.val_iter(count, self.recorder), count)
        finally:
            if saved is not None:
                flat.copy_(saved)
        return tuple(self.recorder.val)  # type: ignore[return-value]

    def state_dict(self) -> dict[str, Any]:
        """The exchanged ``params`` only: the model's own optimizer and data position are its business."""
        return {"params": self.learners[0].params}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``params``."""
        flat = self.learners[0].params
        if state["params"].shape != flat.shape:
            raise CheckpointError(
                f"checkpoint params hold {state['params'].numel()} values, this model has {flat.numel()}"
            )
        flat.copy_(state["params"])

    def skip(self, count: int) -> None:
        """Theano-MPI-form models read their own data: nothing to skip (resume is not exact for them)."""

    def close(self) -> None:
        """Call the model's ``cleanup()``."""
        self.model.cleanup()
