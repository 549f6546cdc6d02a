"""LOCALSGD — local SGD with periodic, optionally hierarchical, model averaging (Lin et al., ICLR 2020,
"Don't use large mini-batches, use local SGD"; PyTorch's ``model_averaging`` hierarchical averager).

Who sends what to whom, and when:

* Every learner takes its own optimizer steps (momentum buffers stay local, as in BSP ``avg`` mode).
* Every ``period`` (H) steps, after the local step, every learner's weights and BatchNorm buffers become the
  mean over all k learners (ranks × learners per rank): a rank sums its learners in memory, then **one
  allreduce** of the flat parameter buffer (and one of the buffers) crosses ranks.
* ``inner_period`` (H_in, 0 = off, must be < H): at the other multiples of H_in the mean is taken only over
  the learners of one node — this rank's learners plus the ranks of the node-local communicator
  (``comm.split_node()``: MPI shared memory, made once at ``bind``). With one rank per node the inner average
  is the rank's own learners, in memory, with no message at all. Where H_in and H coincide the global
  average wins.

Validation and checkpoints use the mean model: ``sync_state`` computes the mean over all k learners into a
separate buffer (the learners keep their own weights, so validating never changes training) and averages
BatchNorm buffers; ``eval_params`` returns that mean until the next step, else None (learner 0's own).
Learner count changes (``[pool] learners = auto``) need nothing: k is read at every average. Elastic training
(``[elastic] enabled``): after a lost rank the node-local communicator is split again from the survivors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.base import Communicator
from ..config.fields import setting
from ..errors import ConfigError
from .base import Rule
from .registry import RULES

log = logging.getLogger(__name__)


@RULES.register("LOCALSGD")
class LocalSGD(Rule):
    """Local steps; the mean model every ``period`` steps, a node's mean every ``inner_period`` steps."""

    @dataclass(frozen=True)
    class Config:
        """LOCALSGD hyper-parameters."""

        period: int = setting(8, "H: local steps between two averages over all k learners", ge=1)
        inner_period: int = setting(
            0, "H_in: local steps between two averages inside one node (0: off; must be < period)", ge=0
        )

    name = "LOCALSGD"

    def __init__(self, **hyper: Any) -> None:
        super().__init__(**hyper)
        if self.hyper.inner_period and self.hyper.inner_period >= self.hyper.period:
            raise ConfigError(
                f"[rule] inner_period: {self.hyper.inner_period} must be less than period "
                f"({self.hyper.period}), or 0 for no inner averaging"
            )
        self.node: Communicator | None = None
        self._mean: torch.Tensor | None = None

    def on_bind(self) -> None:
        """Make the node-local communicator when inner averaging is on."""
        assert self.comm is not None
        if self.hyper.inner_period:
            try:
                self.node = self.comm.split_node()
            except NotImplementedError as exc:
                raise ConfigError(f"[rule] inner_period needs node-local groups: {exc}") from exc
        log.info(
            "%s over %d learner(s): global average every %d step(s), node average %s",
            self.name,
            self.world_learners,
            self.hyper.period,
            f"every {self.hyper.inner_period} step(s) over {self.node.size} rank(s)" if self.node else "off",
        )

    def on_resize(self) -> None:
        """Nothing per learner: k is read from the pool at every average."""
        log.info("%s now over %d learner(s)", self.name, self.world_learners)

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """Elastic training lost ranks: every average divides by the survivors' k already (read from the
        communicator at each use); the node-local communicator, split from the lost world, is split again
        from the survivors' (collective over them; the old one is dropped, not freed — freeing would wait
        on the dead). DILOCO inherits this: z and v are the same on every survivor, restored with the rest
        of the last committed step."""
        assert self.comm is not None
        self._mean = None
        if self.hyper.inner_period:
            self.node = self.comm.split_node()
        log.info(
            "%s now over %d learner(s) after losing rank(s) %s%s",
            self.name,
            self.world_learners,
            lost,
            f"; node average over {self.node.size} rank(s)" if self.node is not None else "",
        )

    @property
    def heals_from_peer(self) -> bool:
        """Every average is ``atomic`` (the learners take the mean once its allreduce completed); between
        averages the learners are each rank's own."""
        return True

    def after_average(self) -> None:
        """Called right after every global average (every learner holds the mean): DILOCO's outer step."""

    def exchange(self, step: int) -> None:
        """After the local step: the global mean every H steps, else the node's mean every H_in steps."""
        self._mean = None
        if (step + 1) % self.hyper.period == 0:
            self.average("params", atomic=True)
            self.average("buffers", atomic=True)
            self.after_average()
        elif self.node is not None and (step + 1) % self.hyper.inner_period == 0:
            self.average("params", self.node, atomic=True)
            self.average("buffers", self.node, atomic=True)

    def averaged_before(self, step: int) -> bool:
        """Yes after the exchange of each H-th step: every learner took the mean of all k, buffers too."""
        return step > 0 and step % self.hyper.period == 0

    def sync_state(self) -> None:
        """The mean over all k learners into a separate buffer; BatchNorm buffers averaged in place (both
        exact: ``[comm] compression`` applies to the training exchanges only)."""
        assert self.comm is not None and self.pool is not None
        learners = self.pool.learners
        mean = learners[0].params.clone()
        for learner in learners[1:]:
            mean.add_(learner.params)
        self.comm.exact.allreduce(mean).wait()
        self._mean = mean.div_(self.world_learners)
        self.average("buffers", self.comm.exact, atomic=True)

    def eval_params(self) -> torch.Tensor | None:
        """The mean model from the last ``sync_state`` (None once a step has run since)."""
        return self._mean
