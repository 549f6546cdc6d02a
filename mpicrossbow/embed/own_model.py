"""OwnModel: a user's own ``nn.Module`` and optimizer as the one learner of a rank, seen by a rule.

``xb.distribute`` hands a rule the same flat buffers ``crossbow-launch``'s pools do: the module's trainable
parameters are re-pointed into one flat tensor (:func:`~mpicrossbow.pool.flat.flatten_into_buffer`), their
gradients into another and the float buffers (BatchNorm statistics) into a third. The module, the user's
optimizer and any learning-rate scheduler keep the very same tensor objects, so the user's code does not
notice; only the storage moved.

Backward writes into the flat gradient as long as each ``.grad`` is its view. The optimizer's ``zero_grad``
is redirected to zero that buffer in place (until :meth:`OwnLearner.release`);
``module.zero_grad()`` or a hand-written ``p.grad = None`` makes autograd allocate fresh tensors, which
:meth:`OwnLearner.gather_grads` copies back in before the rule reads them (one copy, only then).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ContractError
from ..pool.flat import attach_flat_grads, flatten_into_buffer
from ..pool.replica_view import ReplicaView


class OwnLearner:
    """The user's module and optimizer, with flat ``params``, ``grads`` and ``buffers`` (module doc)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        check_model(module, optimizer)
        self.module, self.optimizer = module, optimizer
        self.param_list = [p for p in module.parameters() if p.requires_grad]
        self.device = self.param_list[0].device
        self.params = flatten_into_buffer(self.param_list)
        self.grads = attach_flat_grads(self.param_list, self.params)
        float_buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.buffers = (
            flatten_into_buffer(float_buffers) if float_buffers else torch.zeros(0, device=self.device)
        )
        self._views = [p.grad for p in self.param_list]
        optimizer.zero_grad = self.zero_grad  # type: ignore[method-assign]

    def gather_grads(self) -> None:
        """Make every ``.grad`` its view of :attr:`grads` again, copying a gradient autograd put elsewhere
        (``module.zero_grad()`` set it to None) and zeroing the slice of a parameter that got none."""
        for i, (p, view) in enumerate(zip(self.param_list, self._views, strict=True)):
            self._adopt(i, p, view)

    def _adopt(self, i: int, p: nn.Parameter, view: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        else:
            return
        p.grad = view

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``: zero the flat gradient in place (``set_to_none`` is ignored: the
        views must stay where the rule reads them, and zeros cost one memset)."""
        self.grads.zero_()
        for p, view in zip(self.param_list, self._views, strict=True):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def release(self) -> None:
        """Give the optimizer its own ``zero_grad`` back (the job is over)."""
        if "zero_grad" in vars(self.optimizer):
            del self.optimizer.zero_grad


def check_model(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A ContractError naming what ``xb.distribute`` cannot exchange: no trainable parameters, mixed dtypes
    or devices, or an optimizer that steps tensors that are not the module's parameters."""
    if not isinstance(module, nn.Module):
        raise ContractError(f"xb.distribute needs a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ContractError(f"xb.distribute needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ContractError(f"{type(module).__name__} has no trainable parameters to exchange")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        found = ", ".join(sorted(f"{dtype} on {device}" for dtype, device in kinds))
        raise ContractError(
            f"{type(module).__name__}: every trainable parameter must share one dtype and device, found "
            f"{found}"
        )
    mine = {id(p) for p in params}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in mine)
    if foreign:
        raise ContractError(
            f"the optimizer steps {foreign} tensor(s) that are not trainable parameters of "
            f"{type(module).__name__}; build it from model.parameters()"
        )


class OwnModel(ReplicaView):
    """One :class:`OwnLearner`; ``steps_per_epoch()`` is the user's loader length (None: counted in steps)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        steps_per_epoch: Callable[[], int | None],
        scaled_gradients: bool = False,
        in_backward: bool = True,
    ) -> None:
        self.learners = [OwnLearner(module, optimizer)]
        self._steps_per_epoch = steps_per_epoch
        #: fp16: backward leaves the gradients scaled until the user's GradScaler unscales them.
        self.scaled = scaled_gradients
        #: Whether a rule may exchange during the user's backward (BSP's buckets); not in elastic training,
        #: where a lost rank met there would raise inside autograd, outside the fault tolerance's window.
        self.in_backward = in_backward

    @property
    def learner(self) -> OwnLearner:
        """The one learner."""
        return self.learners[0]

    @property
    def n_batch_train(self) -> int:
        """Batches per epoch of the loader ``xb.shard`` made, or 1 (progress counted in steps) without one."""
        return self._steps_per_epoch() or 1

    def grad_layout(self) -> list[tuple[int, int]] | None:
        """Each trainable parameter's (offset, numel) in the flat gradient, ``module.parameters()`` order;
        None while gradients are loss-scaled (fp16): a step the ranks agree to skip must leave no bucket
        half-counted, so BSP waits for the agreed unscale; None in elastic training (:attr:`in_backward`)."""
        if self.scaled or not self.in_backward:
            return None
        layout, offset = [], 0
        for p in self.learner.param_list:
            layout.append((offset, p.numel()))
            offset += p.numel()
        return layout

    def watch_gradients(self, ready: Callable[[int, int], None]) -> Callable[[], None]:
        """A post-accumulate-grad hook per parameter: bring its gradient into the flat buffer (if autograd
        put it elsewhere), then ``ready(i, 1)``."""
        learner = self.learner

        def hook(p: Any, i: int) -> None:
            learner._adopt(i, p, learner._views[i])
            ready(i, 1)

        handles = [
            p.register_post_accumulate_grad_hook(lambda p, i=i: hook(p, i))
            for i, p in enumerate(learner.param_list)
        ]

        def unwatch() -> None:
            for handle in handles:
                handle.remove()

        return unwatch
