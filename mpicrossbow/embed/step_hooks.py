"""StepHooks: a rule's hooks around the user's own ``optimizer.step()``, in ``crossbow-launch``'s order.

``crossbow-launch`` runs a step as forward and backward, the rule's ``on_gradients`` (BSP's gradient
allreduce, SMA's corrections), the optimizer step, the rule's ``exchange`` (model averaging, elastic pulls,
gossip, pushes to a server). In the user's loop the same order follows from torch's own optimizer hooks,
which call the rule's side of the step as :mod:`mpicrossbow.training.run.step` writes it (``rule_gradients``,
``rule_exchange``, ``overflow_anywhere``), not a copy of it:

* a **step pre-hook** gathers the gradients into the flat buffer and calls ``on_gradients(step)``;
* a **step post-hook** calls ``exchange(step)`` and counts the step;
* a **forward pre-hook** on the module (training mode only) tells the rule when the learning rate changed
  (the user's scheduler), before the forward pass: SMA restarts its replicas from z there, as it does under
  ``crossbow-launch``, where the rate is set before the step's forward pass; in evaluation mode it tells the
  rule that work between steps is under way (``on_pause``: the user's validation, which AUTO leaves out of
  its step timing, as the loop's own).

The gradient noise scale (:class:`~mpicrossbow.training.tuning.noise_scale.NoiseScale`, ``xb.noise_scale()``)
is measured in the pre-hook as ``crossbow-launch``'s step measures it: the gradient before ``on_gradients``
(after fp16's unscale), the rule's mean after it.

Asynchronous rules need nothing more: their ``exchange`` never waits for a collective. :meth:`remove`
takes every hook away again (``xb.finish``).

**Elastic** (``xb.init(elastic=True)``, :mod:`.elastic_mode`): the rule's two calls run inside the fault
tolerance's open window (:meth:`~mpicrossbow.training.elastic.fault_tolerance.FaultTolerance.guard`), and the
post-hook ends the step there — committing the window when it ends, or, after a loss, restoring the state
of the last commit (the optimizer's update of a step that met the loss is undone with the rest). Under a
rule that heals from a peer instead (BSP), a step that met the loss, or that a rank behind skips, hands the
optimizer no gradient (each parameter's ``grad`` is None during its ``step()``, put back after it), so the
user's ``optimizer.step()`` changes nothing there — unless the exchange is redone: BSP's one allreduce can run
again over the survivors (``StepWindow.redoes``), so the pre-hook keeps a copy of the rank's own gradient
before it, put back when every survivor met the loss inside the same step's exchange, and that step trains.

**fp16.** torch's ``GradScaler`` calls ``optimizer.step()`` only on a rank whose gradients did not
overflow, so on the one rank that overflowed the pre-hook, and BSP's allreduce in it, would not run while
its peers wait in theirs. :class:`~.grad_scaler.GradScaler` asks :meth:`StepHooks.agree_overflow` after
unscaling, one allreduce of the flag, so every rank skips together: the order is unscale → agree →
``on_gradients``, as in ``crossbow-launch``'s step. Under ``precision="fp16"`` a step that was not agreed on
is a usage error, named before any rank waits.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..rules.base import Rule
from ..training.run.step import kept_gradients, overflow_anywhere, rule_exchange, rule_gradients
from ..training.run.window import StepWindow, Unguarded
from ..training.tuning.noise_scale import NoiseScale
from .own_model import OwnModel

#: The hooks installed on each distributed optimizer (what :class:`~.grad_scaler.GradScaler` asks).
HOOKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepHooks] = weakref.WeakKeyDictionary()


class StepHooks:
    """Install the rule's hooks on the learner of ``own``; ``step`` counts the optimizer steps taken;
    ``precision`` is ``xb.distribute``'s (fp16: every step must come through an agreeing GradScaler);
    ``noise`` measures the gradient noise scale (None: not measured); ``window``: elastic training's
    owner, whose windows the steps run in (default :class:`Unguarded`: a lost rank ends the job)."""

    def __init__(
        self,
        own: OwnModel,
        rule: Rule,
        step: int = 0,
        precision: str = "fp32",
        noise: NoiseScale | None = None,
        window: StepWindow | None = None,
    ) -> None:
        self.own, self.rule, self.step, self.precision = own, rule, step, precision
        self.noise = noise
        self.window = window if window is not None else Unguarded()
        learner = own.learner
        optimizer = learner.optimizer
        self.lr: float | None = None
        #: The step whose overflow the ranks last agreed on (-1: none yet).
        self.agreed = -1
        #: Gradients held back from the optimizer during a step that does not train (elastic healing).
        self.held: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        HOOKED[optimizer] = self
        self._handles = [
            optimizer.register_step_pre_hook(self._before),
            optimizer.register_step_post_hook(self._after),
            learner.module.register_forward_pre_hook(self._forward),
        ]

    def agree_overflow(self, found: bool) -> bool:
        """Whether any rank's gradients overflowed this step, given this rank's ``found``: one allreduce
        (MAX) among a synchronous rule's ranks; an asynchronous rank decides alone."""
        self.agreed = self.step
        return overflow_anywhere(found, self.rule)

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.precision == "fp16" and self.agreed != self.step:
            raise UsageError(
                "xb.distribute(precision='fp16'): step with an xb.GradScaler (scaler.scale(loss).backward(); "
                "scaler.step(optimizer); scaler.update()), so every rank skips an overflowed step together"
            )
        self.own.learner.gather_grads()
        self.check_lr()
        self.window.begin(self.step)
        exchange = lambda: rule_gradients(self.rule, self.step, self.own, self.noise)  # noqa: E731
        redo = kept_gradients(self.own) if self.window.redoes() else None
        self.window.guard(exchange, f"step {self.step}", redo)
        if not self.window.trains():  # torch's optimizers pass over a parameter without a gradient
            self.held = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
            for param, _ in self.held:
                param.grad = None

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for param, grad in self.held:  # the user's own zero_grad() finds them as it left them
            param.grad = grad
        self.held = []
        self.window.guard(lambda: rule_exchange(self.rule, self.step), f"step {self.step}")
        self.window.end(self.step)
        self.step += 1
        self.window.before_step(lambda: {"step": self.step})  # elastic replacements join between steps

    def _forward(self, module: nn.Module, inputs: Any) -> None:
        if module.training:
            self.check_lr()
        else:  # the user's evaluation, between two steps
            self.rule.on_pause()

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
        HOOKED.pop(self.own.learner.optimizer, None)
