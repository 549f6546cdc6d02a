"""StepHooks: a rule's hooks around the user's own ``optimizer.step()``, in ``crossbow-launch``'s order.

``crossbow-launch`` runs a step as forward and backward, the rule's ``on_gradients`` (BSP's gradient
allreduce, SMA's corrections), the optimizer step, the rule's ``exchange`` (model averaging, elastic pulls,
gossip, pushes to a server). In the user's loop the same order follows from torch's own optimizer hooks:

* a **step pre-hook** gathers the gradients into the flat buffer and calls ``on_gradients(step)``;
* a **step post-hook** calls ``exchange(step)`` and counts the step;
* a **forward pre-hook** on the module (training mode only) tells the rule when the learning rate changed
  (the user's scheduler), before the forward pass: SMA restarts its replicas from z there, as it does under
  ``crossbow-launch``, where the rate is set before the step's forward pass.

Asynchronous rules need nothing more: their ``exchange`` never waits for a collective. :meth:`remove`
takes every hook away again (``xb.finish``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..rules.base import Rule
from .own_model import OwnModel


class StepHooks:
    """Install the rule's hooks on the learner of ``own``; ``step`` counts the optimizer steps taken."""

    def __init__(self, own: OwnModel, rule: Rule, step: int = 0) -> None:
        self.own, self.rule, self.step = own, rule, step
        learner = own.learner
        optimizer = learner.optimizer
        self.lr: float | None = None
        self._handles = [
            optimizer.register_step_pre_hook(self._before),
            optimizer.register_step_post_hook(self._after),
            learner.module.register_forward_pre_hook(self._forward),
        ]

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.own.learner.gather_grads()
        self.check_lr()
        self.rule.on_gradients(self.step)

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.rule.exchange(self.step)
        self.step += 1

    def _forward(self, module: nn.Module, inputs: Any) -> None:
        if module.training:
            self.check_lr()

    def check_lr(self) -> None:
        """Tell the rule when the first parameter group's learning rate changed since the last step."""
        lr = float(self.own.learner.optimizer.param_groups[0]["lr"])
        if self.lr is not None and lr != self.lr:
            self.rule.on_lr_change(self.lr, lr)
        self.lr = lr

    def remove(self) -> None:
        """Take every hook away."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
