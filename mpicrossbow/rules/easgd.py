"""EASGD — elastic averaging SGD, synchronous form (Zhang, Choromanska, LeCun, NIPS 2015; Theano-MPI, SpeeDO).

Who sends what to whom, and when: learners take plain local steps; every τ steps each learner computes its
elastic difference ``d_i = x_i − x~`` from the values before the update, the differences of a rank's
learners are summed in memory and **one allreduce** sums them across ranks; then every learner moves toward
the centre, ``x_i ← x_i − α d_i``, and every rank moves its identical copy of the centre,
``x~ ← x~ + α Σ_i d_i``. Validation and checkpoints use the centre.

``momentum = δ`` turns the local step into EAMSGD's Nesterov momentum (``v ← δ v − η g(x + δ v)``; every
learner's optimizer gets ``nesterov = True`` and momentum δ); left unset, the local step is the learner's
optimizer from ``[optim]``. ``alpha`` defaults to 0.9/k (the paper's β = kα = 0.9); Theano-MPI used 0.5.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..validate import setting
from .base import Rule
from .registry import RULES

log = logging.getLogger(__name__)


@RULES.register("EASGD")
class EASGD(Rule):
    """Elastic averaging every τ steps through one allreduce (``mode = sync``)."""

    @dataclass(frozen=True)
    class Config:
        """EASGD hyper-parameters."""

        alpha: float | None = setting(None, "elastic rate α (default 0.9/k, k = learners in all)", gt=0, le=1)
        tau: int = setting(10, "communication period τ in local steps", ge=1)
        momentum: float | None = setting(
            None, "EAMSGD: Nesterov momentum δ of the local step (unset: [optim])", ge=0, lt=1
        )

    name = "EASGD"

    def on_bind(self) -> None:
        """The centre starts as the broadcast replica; EAMSGD reconfigures the local optimizers."""
        assert self.pool is not None
        k = self.world_learners
        self.alpha = self.hyper.alpha if self.hyper.alpha is not None else 0.9 / k
        if k * self.alpha > 1:
            log.warning(
                "EASGD: k·α = %d × %g > 1: the centre overshoots (the paper needs β = kα < 1)", k, self.alpha
            )
        self.centre = self.pool.learners[0].params.clone()
        self.diffs = [torch.zeros_like(self.centre) for _ in self.pool.learners]
        if self.hyper.momentum is not None:
            for learner in self.pool.learners:
                for group in learner.optimizer.param_groups:
                    group.update(momentum=self.hyper.momentum, nesterov=self.hyper.momentum > 0, dampening=0)

    def exchange(self, step: int) -> None:
        """Every τ-th step: d_i = x_i − x~, one allreduce of Σ d_i, then the elastic moves."""
        if (step + 1) % self.hyper.tau:
            return
        assert self.pool is not None and self.comm is not None
        for learner, d in zip(self.pool.learners, self.diffs, strict=True):
            torch.sub(learner.params, self.centre, out=d)
            learner.params.sub_(d, alpha=self.alpha)
        total = self.diffs[0]
        for d in self.diffs[1:]:
            total.add_(d)
        self.comm.allreduce(total).wait()
        self.centre.add_(total, alpha=self.alpha)

    def eval_params(self) -> torch.Tensor:
        """Validate (and save) the centre x~."""
        return self.centre

    def state_dict(self) -> dict[str, Any]:
        """The centre and the resolved α."""
        return {**super().state_dict(), "centre": self.centre.clone(), "alpha": self.alpha}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the centre and α."""
        self.centre.copy_(state["centre"])
        self.alpha = float(state["alpha"])
