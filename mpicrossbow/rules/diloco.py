"""DILOCO — distributed low-communication training (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models"; torchft's DiLoCo).

Who sends what to whom, and when: every learner takes ``period`` (H) inner steps with its own optimizer
(``[optim]``) from the outer model z, which every rank keeps an identical copy of. Then a rank sums its
learners' weights in memory and **one allreduce** of the flat parameter buffer gives the mean ``w̄`` over all
k learners (BatchNorm buffers are averaged the same way). Every rank then applies the outer optimizer, SGD
with Nesterov momentum, to the pseudo-gradient ``Δ = z − w̄``, exactly as ``torch.optim.SGD(lr=η_out,
momentum=μ_out, nesterov=True)`` (dampening 0, no weight decay) would:

    v ← μ_out v + Δ            (v starts at 0, so the first v is Δ, as torch's first momentum buffer)
    z ← z − η_out (Δ + μ_out v)

and every learner restarts from z (its inner momentum buffer is kept). With ``outer_lr = 1`` and
``outer_momentum = 0`` this is z ← w̄: LOCALSGD, which DILOCO extends (the average every H steps, and
LOCALSGD's optional node-local average every ``inner_period`` steps in between, then the outer step).
Validation and checkpoints use z; checkpoints hold z and v.

Defaults: ``outer_lr`` 0.7 and ``outer_momentum`` 0.9 are the paper's; its H = 500 inner steps suits
language-model pre-training of many thousands of steps, so ``period`` defaults to 8 here, like LOCALSGD's,
for jobs of a few hundred steps per rank (the bundled digits job has about 20 steps per epoch on 4 ranks).
Learner count changes need nothing: k is read at every average, and new learners copy learner 0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config.fields import setting
from .localsgd import LocalSGD
from .registry import RULES

log = logging.getLogger(__name__)


@RULES.register("DILOCO")
class DiLoCo(LocalSGD):
    """LOCALSGD's averages, then an outer Nesterov-momentum step on z from the pseudo-gradient z − mean(w)."""

    @dataclass(frozen=True)
    class Config(LocalSGD.Config):
        """DILOCO hyper-parameters (the inner optimizer is ``[optim]``)."""

        period: int = setting(8, "H: inner steps between two outer steps", ge=1)
        outer_lr: float = setting(0.7, "η_out: learning rate of the outer Nesterov SGD on z", gt=0)
        outer_momentum: float = setting(0.9, "μ_out: Nesterov momentum of the outer SGD on z", ge=0, lt=1)

    name = "DILOCO"

    def on_bind(self) -> None:
        """z starts as the (broadcast) replica; the outer momentum v as zeros."""
        super().on_bind()
        assert self.pool is not None
        self.z = self.pool.learners[0].params.clone()
        self.v = torch.zeros_like(self.z)
        self.delta = torch.zeros_like(self.z)
        log.info("DILOCO outer step: η_out = %g, μ_out = %g", self.hyper.outer_lr, self.hyper.outer_momentum)

    def after_average(self) -> None:
        """Every learner holds w̄: Δ = z − w̄, the outer Nesterov step on z, learners ← z."""
        assert self.pool is not None
        mu, lr = self.hyper.outer_momentum, self.hyper.outer_lr
        torch.sub(self.z, self.pool.learners[0].params, out=self.delta)
        self.v.mul_(mu).add_(self.delta)
        self.z.sub_(self.delta.add_(self.v, alpha=mu), alpha=lr)
        for learner in self.pool.learners:
            learner.params.copy_(self.z)

    def sync_state(self) -> None:
        """Average BatchNorm running statistics so every rank validates the same model (exactly)."""
        assert self.comm is not None
        self.average("buffers", self.comm.exact, atomic=True)

    def eval_params(self) -> torch.Tensor:
        """Validate (and save) the outer model z."""
        return self.z

    def state_dict(self) -> dict[str, Any]:
        """The outer model z and its momentum v."""
        return {**super().state_dict(), "z": self.z.clone(), "v": self.v.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore z and v."""
        self.z.copy_(state["z"])
        self.v.copy_(state["v"])
