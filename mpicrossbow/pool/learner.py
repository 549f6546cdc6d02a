"""One learner: a model replica, its optimizer and the flat buffers a rule exchanges."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..config import OptimSection
from ..errors import CheckpointError, ContractError
from .cuda_graphs import GraphedStep
from .flat import attach_flat_grads, flatten_into_buffer
from .precision import FP32, Precision
from .step_gradients import StepGradients


class Learner:
    """A replica whose parameters, gradients and float buffers each live in one flat tensor.

    ``params``, ``grads`` and ``buffers`` are what rules read and write; the module and optimizer see the
    same storage. Loss, hits and sample counts accumulate on the device (no host sync per step) until
    :meth:`take_stats` reads them.
    """

    def __init__(
        self,
        module: nn.Module,
        model: Any,
        optim: OptimSection,
        device: torch.device,
        precision: Precision = FP32,
    ) -> None:
        self.model = model
        #: The pool's precision: the forward's autocast and the loss scale (one for every learner).
        self.precision = precision
        self.device = device
        self.module = module.to(device)
        self.param_list = [p for p in self.module.parameters() if p.requires_grad]
        if not self.param_list:
            raise ContractError(
                f"{type(model).__name__}.module() returned a network with no trainable parameters"
            )
        dtypes = {p.dtype for p in self.param_list}
        if len(dtypes) > 1:
            raise ContractError(
                f"{type(model).__name__}: all parameters must share one dtype, found {dtypes}"
            )
        self.params = flatten_into_buffer(self.param_list)
        self.grads = attach_flat_grads(self.param_list, self.params)
        #: The step's gradient contract over the flat gradient (zeroed, then the scaled loss's backward).
        self.gradients = StepGradients(self.grads, precision)
        float_buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        self.buffers = flatten_into_buffer(float_buffers) if float_buffers else torch.zeros(0, device=device)
        self.optimizer = model.optimizer(self.param_list, optim)
        self._stats = torch.zeros(3, dtype=torch.float64, device=device)
        #: The loss of the last training batch (on the device): the session checks it is finite.
        self.last_loss = torch.zeros((), device=device)
        #: The step's CUDA graph (:mod:`.cuda_graphs`), set by the pool where it captures; None: eager.
        self.graph: GraphedStep | None = None

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Zero the flat gradient, run forward and backward on one batch, accumulate the batch's stats:
        through :attr:`graph` where the pool captures the step (:mod:`.cuda_graphs`), else eagerly."""
        if self.graph is None:
            self.module.train()
            self.last_loss = self.train_batch(inputs, targets)
            return
        if not self.module.training:  # a replay does not read it; an eager warm-up step does
            self.module.train()
        self.last_loss = self.graph(inputs, targets, setting=self.precision.scale)

    def train_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The device work of one training batch (what a CUDA graph captures): zero the flat gradient,
        forward, loss, backward, add the batch's stats; returns the loss (float32, on the device)."""
        self.gradients.start()
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        with self.precision.autocast():
            output = self.module(inputs)
            loss = self.model.loss(output, targets)
        self.gradients.backward(loss)
        with torch.no_grad():
            last_loss = loss.detach().float()
            hits = torch.as_tensor(
                self.model.correct(output, targets), dtype=torch.float64, device=self.device
            )
            # A fill, not a copy from the host: a graph can capture it.
            n = torch.full((), float(len(targets)), dtype=torch.float64, device=self.device)
            row = torch.stack([last_loss.double() * n, hits, n])
            self._stats += torch.where(torch.isfinite(last_loss), row, torch.zeros_like(row))
        return last_loss

    def step(self) -> None:
        """Apply the optimizer to the (possibly exchanged) flat gradient."""
        self.optimizer.step()

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """Replica, float buffers, optimizer state and running stats (tensors and plain values only)."""
        return {
            "params": self.params,
            "buffers": self.buffers,
            "optimizer": self.optimizer.state_dict(),
            "stats": self._stats,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values in place (the flat buffers keep their storage)."""
        for name in ("params", "buffers", "stats"):
            mine = self._stats if name == "stats" else getattr(self, name)
            theirs = state[name]
            if theirs.shape != mine.shape:
                raise CheckpointError(
                    f"checkpoint {name} hold {theirs.numel()} values, this model has {mine.numel()}: "
                    "another model or model configuration"
                )
            mine.copy_(theirs)
        self.optimizer.load_state_dict(state["optimizer"])

    def take_stats(self) -> tuple[float, float, float]:
        """(loss sum, hits, samples) since the last call, then reset."""
        loss, hits, n = self._stats.tolist()
        self._stats.zero_()
        return loss, hits, n

    def evaluate(self, batches: Any) -> tuple[float, float, float]:
        """(loss sum, hits, samples) of this replica over ``batches``, in eval mode."""
        return evaluate(self.module, self.model, self.device, batches, self.precision)


@torch.no_grad()
def evaluate(
    module: nn.Module, model: Any, device: torch.device, batches: Any, precision: Precision = FP32
) -> tuple[float, float, float]:
    """(loss sum, hits, samples) of one replica ``module`` over ``batches``, in eval mode, in the arithmetic
    it trains in (``precision``'s autocast).

    Shared by every engine, so a replica validates the same way whichever engine trained it.
    """
    module.eval()
    loss_sum, hits, n = 0.0, 0.0, 0.0
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with precision.autocast():
            output = module(inputs)
            loss = model.loss(output, targets)
        loss_sum += float(loss) * len(targets)
        hits += float(model.correct(output, targets))
        n += len(targets)
    return loss_sum, hits, n
