"""SMA — synchronous model averaging (Crossbow, Koliousis et al., VLDB 2019).

Who sends what to whom, and when: every step, each learner j computes its correction
``c_j = α (w_j − z)`` from its weights *before* its local step, takes the local step (the learner's
optimizer: ``v_j ← μ_l v_j − η g_j``) and subtracts ``c_j``. The corrections of a rank's learners are summed
in memory and **one allreduce per step** sums them across ranks — the volume does not grow with learners
per rank. Every rank then moves its identical copy of the central model: ``z ← z + Σ_j c_j + μ (z − z_prev)``.

The allreduce is started without waiting and completed at the start of the next step, so it overlaps the
next forward and backward pass (Crossbow lets a learner start step t+1 once its step t is done).
Learners start from z; when the learning-rate schedule steps down every replica is reset to z (the
learners keep their momentum buffers, as Crossbow's do). Validation and checkpoints use z. ``alpha`` defaults
to ``min(0.2, 0.9 × the stability bound)`` (:mod:`.sma_stability`); an explicit α at or past the bound
``2 (1 + μ) / (k + 1 + μ)`` is a ConfigError, since the consensus loop then diverges whatever the gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.base import Handle
from ..comm.ulfm import PeerLost
from ..config.fields import setting
from ..errors import ConfigError
from .base import Rule
from .registry import RULES
from .sma_stability import alpha_bound, default_alpha

log = logging.getLogger(__name__)


@RULES.register("SMA")
class SMA(Rule):
    """Synchronous model averaging with a momentum-carrying central model z."""

    @dataclass(frozen=True)
    class Config:
        """SMA hyper-parameters (μ_l, the learners' momentum, is ``[optim] momentum``)."""

        alpha: float | None = setting(
            None,
            "elastic rate α (default min(0.2, 0.9 x the stability bound); an α at or past the bound "
            "2(1+momentum)/(k+1+momentum), k = learners in all, is an error)",
            ge=0,
            le=1,
        )
        momentum: float = setting(0.9, "momentum μ of the central model z", ge=0, lt=1)

    name = "SMA"

    def on_bind(self) -> None:
        """z starts as the (broadcast) replica; allocate one correction buffer per learner."""
        assert self.pool is not None
        first = self.pool.learners[0].params
        self.z = first.clone()
        self.z_prev = first.clone()
        self._pending: Handle | None = None
        self.on_resize()

    def on_resize(self) -> None:
        """α (when defaulted) and one correction buffer per learner follow the learner count.

        Learners added by the auto-tuner start from z, as every learner did. An explicit α at or past the
        stability bound for the current k is a ConfigError (at bind, or when the auto-tuner grows k).
        """
        assert self.pool is not None and self.comm is not None
        self._complete()
        for learner in self.pool.learners[len(getattr(self, "corrections", [])) :]:
            learner.params.copy_(self.z)
        k, mu = self.world_learners, self.hyper.momentum
        self.check_learners(k)
        self.alpha = self.hyper.alpha if self.hyper.alpha is not None else default_alpha(k, mu)
        log.info(
            "SMA: α = %.4g%s, z's momentum μ = %g over k = %d learner(s) (stability bound %.4g)",
            self.alpha,
            "" if self.hyper.alpha is not None else " (default)",
            mu,
            k,
            alpha_bound(k, mu),
        )
        self.corrections = [torch.zeros_like(self.z) for _ in self.pool.learners]
        self.comm.share(self.corrections[0])  # the buffer every step's allreduce sums

    def check_learners(self, k: int) -> None:
        """An explicit α at or past the stability bound 2(1+μ)/(k+1+μ) for ``k`` learners is a ConfigError:
        the consensus loop diverges there whatever the gradients (:mod:`.sma_stability`)."""
        mu, alpha = self.hyper.momentum, self.hyper.alpha
        bound = alpha_bound(k, mu)
        if alpha is not None and alpha >= bound:
            raise ConfigError(
                f"[rule] alpha = {alpha:g} is past SMA's stability bound 2(1+μ)/(k+1+μ) = {bound:.4g} for "
                f"k = {k} learners and momentum μ = {mu:g}: the learners and z diverge; leave alpha unset "
                f"(default {default_alpha(k, mu):.4g}) or lower it"
            )

    def _complete(self) -> None:
        """Finish the last step's allreduce and move z: z ← z + Σc + μ (z − z_prev)."""
        if self._pending is None:
            return
        self._pending.wait()
        self._pending = None
        total = self.corrections[0]
        step = total.add_(self.z - self.z_prev, alpha=self.hyper.momentum)
        self.z_prev.copy_(self.z)
        self.z.add_(step)

    def on_gradients(self, step: int) -> None:
        """c_j = α (w_j − z) with the weights from before this step's update."""
        self._complete()
        assert self.pool is not None
        for learner, c in zip(self.pool.learners, self.corrections, strict=True):
            torch.sub(learner.params, self.z, alpha=1.0, out=c).mul_(self.alpha)

    def exchange(self, step: int) -> None:
        """w_j ← w_j − c_j after the local step; sum the c_j locally and start one allreduce."""
        assert self.pool is not None and self.comm is not None
        for learner, c in zip(self.pool.learners, self.corrections, strict=True):
            learner.params.sub_(c)
        total = self.corrections[0]
        for c in self.corrections[1:]:
            total.add_(c)
        self._pending = self.comm.allreduce(total, async_op=True)

    @property
    def heals_from_peer(self) -> bool:
        """z moves only once its allreduce completed (the corrections are summed in a buffer of their own),
        and every rank moves it alike."""
        return True

    @property
    def unapplied_steps(self) -> int:
        """1 while a step's allreduce is in flight: z has not moved for it yet (a loss met in its wait, at
        the next step's start, leaves z one step behind a peer whose allreduce completed)."""
        return int(self._pending is not None)

    def on_lr_change(self, old: float, new: float) -> None:
        """When the rate steps down, every replica restarts from z."""
        if new < old:
            self._complete()
            assert self.pool is not None
            for learner in self.pool.learners:
                learner.params.copy_(self.z)

    def sync_state(self) -> None:
        """Complete the step in flight so z is current, and average the BatchNorm running statistics (exact)
        so every rank validates z with the same ones."""
        assert self.comm is not None
        self._complete()
        self.average("buffers", self.comm.exact, atomic=True)

    def eval_params(self) -> torch.Tensor:
        """Validate (and save) the central model z."""
        self._complete()
        return self.z

    def finish(self) -> None:
        """No allreduce is left in flight."""
        self._complete()

    def state_dict(self) -> dict[str, Any]:
        """z, z_prev and the resolved α."""
        self._complete()
        return {
            **super().state_dict(),
            "z": self.z.clone(),
            "z_prev": self.z_prev.clone(),
            "alpha": self.alpha,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore z, z_prev and an explicit α (a default α follows k, set at bind, resize and rebind: on a
        resume the same k gives the same value; after an elastic loss it is the survivors')."""
        self._complete()
        self.z.copy_(state["z"])
        self.z_prev.copy_(state["z_prev"])
        if self.hyper.alpha is not None:
            self.alpha = float(state["alpha"])

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """Elastic training lost ranks: the allreduce in flight met the loss and is dropped (the loop
        restores z from the last committed step next); α (when defaulted) follows the survivors' k, and every
        mean's divisor is the communicator's size at its use."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:  # completes with the loss's error; a request left pending would hold up MPI_Finalize
                pending.wait()
            except PeerLost:
                pass
        self.on_resize()
