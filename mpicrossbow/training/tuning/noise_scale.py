"""The gradient noise scale B_noise = tr(Σ)/|G|², measured from the gradients a step already holds.

McCandlish et al., *An Empirical Model of Large-Batch Training* (2018), appendix A.1: the squared norm of a
gradient averaged over B samples has expectation |G|² + tr(Σ)/B, so two batch sizes B_small < B_big give
unbiased estimates

    |G|²  ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

and B_noise, the batch size beyond which larger batches stop paying off, is their ratio. Each is smoothed by
an exponential moving average first (the ratio of averages, as the paper does: a single step's |G|²
estimate is often tiny or negative). A pool's step holds both batch sizes for free: each learner's gradient
over its batch b (B_small = b; |G_small|² is the mean of the learners' squared norms) and their mean over n
learners (B_big = n·b). With B_small = b the formulas read, in units of one learner's batch,

    |G|² ≈ (n |G_big|² − |G_small|²)/(n − 1),    tr(Σ)/b ≈ n (|G_small|² − |G_big|²)/(n − 1)

so the probe keeps both in those units and B_noise in samples is b × their ratio (:meth:`NoiseScale.value`).

**Which learners form the big batch** (read where a step already holds them; never an extra allreduce of a
whole gradient):

* a rule whose ``on_gradients`` leaves every learner's gradient the mean over all k learners
  (:attr:`~mpicrossbow.rules.base.Rule.averages_gradients`: BSP in ``grad`` mode) — n = k: the squared
  norms are taken before the hook, |G_big|² after it from the mean the rule computed anyway;
* any other synchronous rule — n = m, the rank's own learners (their mean is summed locally), each rank's
  two estimates are averaged over the ranks with m ≥ 2;
* an asynchronous rule — n = m as well, but the ranks run no collective between bind and finish: each rank
  keeps its own estimate.

Both synchronous cases cost one ``allreduce_scalars`` of three floats per estimate; every estimate costs one
host synchronisation. Where no big batch exists (one learner on one rank, or m = 1 under a rule that does not
average gradients) B_noise is not estimable and stays NaN, said once in the log. Under rules whose
replicas differ between exchanges (SMA, EASGD, LOCALSGD) the learners' gradients are taken at nearby but
different weights, so the estimate also counts that spread as noise.

The probe is called by :func:`~mpicrossbow.training.run.step.train_step` and by the embedded API's
:class:`~mpicrossbow.embed.step_hooks.StepHooks` at the same two places: after fp16's unscale (a skipped step
is never seen) and around the rule's ``on_gradients``. Its averages travel in checkpoints
(:meth:`state_dict`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...comm.base import Communicator
from ...pool.replica_view import ReplicaView
from ...rules.base import Rule

log = logging.getLogger(__name__)

#: Gradient dtypes summed as they are; narrower ones (fp16, bf16) are widened to float32 first.
WIDE = (torch.float32, torch.float64)


def squared_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each flat gradient's squared L2 norm (at least float32), as one tensor on their device (no host
    sync)."""
    norms = torch._foreach_norm([g if g.dtype in WIDE else g.float() for g in grads])
    return torch.stack(norms).square()


def two_batch_estimates(small: float, big: float, n: float) -> tuple[float, float]:
    """Unbiased ``(|G|², tr(Σ)/b)`` from the mean squared norm of n gradients of batch b (``small``) and
    the squared norm of their mean (``big``); NaN for n < 2, where the two batch sizes coincide."""
    if n < 2:
        return math.nan, math.nan
    return (n * big - small) / (n - 1), n * (small - big) / (n - 1)


class NoiseScale:
    """The smoothed gradient noise scale of one rank's training (module doc): ``before`` and ``after``
    around the rule's ``on_gradients`` every ``every`` steps (0: never), ``value(b)`` for B_noise in
    samples. ``smoothing`` is the moving averages' decay per estimate."""

    def __init__(self, every: int, smoothing: float, record: str = "metrics.h5 holds NaN") -> None:
        self.every, self.smoothing = every, smoothing
        #: Where a value that cannot be estimated shows as NaN, for the one line that says so.
        self.record = record
        #: Moving averages of |G|² and tr(Σ)/b, bias-corrected by ``weight`` (the decayed count).
        self.sqr, self.var, self.weight = 0.0, 0.0, 0.0
        #: Estimates taken so far (over a resume too).
        self.estimates = 0
        self._pending: tuple[torch.Tensor, int, bool] | None = None
        self._scratch: torch.Tensor | None = None
        self._told = False

    def due(self, step: int) -> bool:
        """Whether step ``step`` is measured."""
        return self.every > 0 and step % self.every == 0

    def before(self, step: int, replicas: ReplicaView, rule: Rule) -> None:
        """After backward (and fp16's unscale), before ``on_gradients``: read every learner's own gradient.
        Queues device work only; :meth:`after` finishes the estimate."""
        self._pending = None
        if not self.due(step) or not replicas.has_gradients:
            return
        grads = [learner.grads for learner in replicas.learners]
        pooled = rule.averages_gradients and rule.comm is not None and rule.synchronous
        norms = squared_norms(grads)
        if pooled:  # the rule's mean over all k learners is read after the hook
            local = torch.stack([norms.sum(), torch.zeros_like(norms[0])])
        else:
            local = torch.stack([norms.mean(), self._local_mean_sqr(grads)])
        self._pending = (local, len(grads), pooled)

    def _local_mean_sqr(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """|mean of the rank's learners' gradients|² (a zero tensor for one learner: not used)."""
        if len(grads) < 2:
            return torch.zeros((), device=grads[0].device)
        scratch = self._scratch
        if scratch is None or scratch.shape != grads[0].shape or scratch.device != grads[0].device:
            wide = grads[0].dtype if grads[0].dtype in WIDE else torch.float32
            scratch = self._scratch = torch.empty_like(grads[0], dtype=wide)
        scratch.copy_(grads[0])
        for g in grads[1:]:
            scratch.add_(g)
        return torch.linalg.vector_norm(scratch).square() / len(grads) ** 2

    def after(self, step: int, replicas: ReplicaView, rule: Rule) -> None:
        """After ``on_gradients``: the big batch's norm where the rule averaged, one host sync, the ranks'
        sums where the rule is synchronous, and one update of the averages."""
        if self._pending is None:
            return
        local, m, pooled = self._pending
        self._pending = None
        if pooled:
            local[1] = squared_norms([replicas.learners[0].grads])[0]
        small, big = local.tolist()  # the one host synchronisation
        comm = rule.comm.exact if rule.comm is not None and rule.synchronous else None
        if pooled:
            assert comm is not None
            total, learners = comm.allreduce_scalars([small, float(m)])
            sqr, var = two_batch_estimates(total / learners, big, learners)
        else:
            sqr, var = self._combined(two_batch_estimates(small, big, m), comm)
        self._update(sqr, var)

    def _combined(self, mine: tuple[float, float], comm: Communicator | None) -> tuple[float, float]:
        """The mean of the ranks' own estimates where a communicator joins them (ranks that cannot estimate
        left out); this rank's alone otherwise."""
        if comm is None:
            return mine
        usable = all(math.isfinite(v) for v in mine)
        sqr, var, ranks = comm.allreduce_scalars([*(mine if usable else (0.0, 0.0)), float(usable)])
        return (sqr / ranks, var / ranks) if ranks else (math.nan, math.nan)

    def _update(self, sqr: float, var: float) -> None:
        """Fold one estimate into the moving averages (a non-finite one is left out, said once)."""
        if not (math.isfinite(sqr) and math.isfinite(var)):
            if not self._told:
                log.info(
                    "gradient noise scale: not estimable here (it needs gradients of 2 or more learners "
                    "over one big batch: pool.learners >= 2, or BSP in grad mode over 2 or more ranks); %s",
                    self.record,
                )
                self._told = True
            return
        decay = self.smoothing
        self.sqr = decay * self.sqr + (1 - decay) * sqr
        self.var = decay * self.var + (1 - decay) * var
        self.weight = decay * self.weight + (1 - decay)
        self.estimates += 1

    def value(self, batch_size: int) -> float:
        """B_noise in samples for learners of batch ``batch_size``: b × the smoothed tr(Σ)/b over the
        smoothed |G|²; NaN before the first estimate, or while the smoothed |G|² is not yet positive (the
        gradient is still lost in its noise)."""
        if not self.weight or self.sqr <= 0:
            return math.nan
        return batch_size * self.var / self.sqr

    def gradient_sqr(self) -> float:
        """The smoothed |G|² (bias-corrected); NaN before the first estimate."""
        return self.sqr / self.weight if self.weight else math.nan

    def state_dict(self) -> dict[str, Any]:
        """The moving averages, for a checkpoint (plain floats)."""
        return {"sqr": self.sqr, "var": self.var, "weight": self.weight, "estimates": self.estimates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the averages :meth:`state_dict` saved (an empty mapping: start afresh)."""
        self.sqr = float(state.get("sqr", 0.0))
        self.var = float(state.get("var", 0.0))
        self.weight = float(state.get("weight", 0.0))
        self.estimates = int(state.get("estimates", 0))
