"""Evaluation: validating the model a rule names, on every rank's shard together or on one rank alone.

Synchronous rules validate collectively: ``sync_state`` makes the model consistent (BatchNorm statistics
averaged, say), every rank validates its shard of the validation set, one allreduce sums the counts.
Asynchronous rules validate alone, on the whole validation set, until ``finish``; then rank 0 validates the
rule's final model and every rank's own model is reported beside it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...comm.base import Communicator
from ...launch.world import FollowsWorld, World, WorldView
from ...pool.base import LearnerPool
from ...rules.base import Rule
from ..reporting.reporting import Reporter


def per_sample(loss_sum: float, hits: float, n: float) -> tuple[float, float]:
    """(mean loss, accuracy) from summed ``(loss, hits, samples)``; NaN for what nothing was measured of (no
    samples, or a model that reports no errors: a NaN sum), never a 0 that looks like a measurement."""
    if n <= 0:
        return math.nan, math.nan
    return loss_sum / n, hits / n


class Evaluator(FollowsWorld):
    """Validation of this rank's pool, with the rule's model; ``full_val`` is the whole validation set for
    ranks that validate alone (None: the pool's own shard)."""

    def __init__(
        self,
        pool: LearnerPool,
        rule: Rule,
        comm: Communicator,
        world: World | WorldView,
        reporter: Reporter,
        full_val: Any = None,
    ) -> None:
        self.follow(world)  # the run's shared view: elastic training moves it on
        self.pool, self.rule, self.comm = pool, rule, comm
        self.reporter, self.full_val = reporter, full_val

    def collective(self) -> tuple[float, float]:
        """Every rank's shard, summed (a collective: synchronous rules)."""
        self.rule.sync_state()
        return per_sample(*self.comm.allreduce_scalars(list(self.pool.validate(self.rule.eval_params()))))

    def alone(self) -> tuple[float, float]:
        """This rank alone, on the whole validation set (asynchronous rules, no collective)."""
        return per_sample(*self.pool.validate(self.rule.eval_params(), self.full_val))

    def served(self, params: torch.Tensor, epoch: float) -> None:
        """Validation callback of a serving rank: rank 0 validates ``params`` and reports it."""
        if self.world.rank == 0:
            self.reporter.served(per_sample(*self.pool.validate(params, self.full_val)), epoch)

    def final(self, trains: bool) -> tuple[float, float]:
        """After ``finish`` (collective): rank 0 validates the rule's model, every rank's own is reported."""
        self.rule.sync_state()
        own = self.pool.validate(None, self.full_val) if trains else (math.nan, math.nan, 1.0)
        mine = own[1] / max(own[2], 1)
        every_rank = self.world.allgather(mine)
        val = None
        if self.world.rank == 0:
            val = per_sample(*self.pool.validate(self.rule.eval_params(), self.full_val))
            self.reporter.final_model(val, every_rank)
        return self.world.bcast(val)  # type: ignore[return-value]
