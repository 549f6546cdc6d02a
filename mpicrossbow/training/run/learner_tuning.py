"""The training loop's side of the learner auto-tuner: measure an epoch, agree across ranks, resize.

:class:`~.autotune.AutoTuner` decides; :class:`LearnerTuning` feeds it once per epoch (a change reshards the
data, which is only clean between epochs) and applies its answer. The throughput is measured as
benchmarks/pool.py measures a pool (:class:`StepMeter`): samples over the time of the training steps alone,
the steps of the fused engine's form trial, validations and checkpoints left out; the slowest rank's median
step sets a synchronous job's pace, agreed by one allreduce so every rank makes the same decision. B_noise
is the loop's smoothed gradient noise scale (:mod:`.noise_scale`), already the same on every rank of a
synchronous rule.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from ...comm.base import ReduceOp
from ..tuning.autotune import AutoTuner
from .parts import RankParts


@dataclass
class StepMeter:
    """Seconds per training step over one epoch's steady steps (their median): the auto-tuner's measurement.

    A step taken while the pool is :attr:`~mpicrossbow.pool.base.LearnerPool.warming_up` (the fused engine
    timing its forms, which alternates a slower form in) is left out, as are validations and checkpoints
    between steps (not steps): a larger learner count, whose first epoch holds a new trial, is then not
    judged by the trial's speed. The median, not the mean: a burst of another process's work on a shared
    node (or a page fault, a garbage collection) stretches a few steps, and a mean lets those few move
    the decision; a count's typical step is what it will cost from now on.
    """

    seconds: list[float] = field(default_factory=list)

    def add(self, seconds: float, steady: bool) -> None:
        """One training step's ``seconds``, counted when it was ``steady``."""
        if steady:
            self.seconds.append(seconds)

    def take(self) -> float | None:
        """Median seconds of the steady steps since the last call (None: there was none); starts anew."""
        median = statistics.median(self.seconds) if self.seconds else None
        self.seconds = []
        return median


class LearnerTuning:
    """One rank's auto-tuning checks: :meth:`check` after an epoch measures it, asks the tuner and resizes
    the pool (and tells the rule) when the count changes."""

    def __init__(self, parts: RankParts, tuner: AutoTuner) -> None:
        self.parts, self.tuner = parts, tuner
        #: The loop adds every training step here (:meth:`StepMeter.add`).
        self.meter = StepMeter()

    def samples_per_step(self) -> int:
        """Samples one step trains over every rank (rank 0's learners × batch size × ranks)."""
        parts = self.parts
        return len(parts.pool.learners) * parts.config.data.batch_size * parts.world.size

    def check(self, samples: float, seconds: float, noise_scale: float) -> bool:
        """After an epoch of ``samples`` (summed over ranks) in ``seconds``: samples/s of its steady steps,
        or of the whole epoch where a rank had none, and ``noise_scale`` (B_noise, NaN: unknown) go to the
        tuner; True when the learner count changed (the pool and rule are resized already)."""
        parts = self.parts
        per_step = self.meter.take()
        # The slowest rank's time sets a synchronous job's pace; samples are summed over ranks already.
        slowest_step, slowest_epoch = parts.comm.allreduce_scalars(
            [math.inf if per_step is None else per_step, seconds], op=ReduceOp.MAX
        )
        if math.isfinite(slowest_step):
            throughput = self.samples_per_step() / max(slowest_step, 1e-9)
        else:
            throughput = samples / max(slowest_epoch, 1e-9)
        before = len(parts.pool.learners)
        after = self.tuner.observe(throughput, noise_scale)
        if after != before:
            parts.pool.resize(after)
            parts.rule.resized()
        parts.reporter.autotune_history(self.tuner.history)
        return after != before

    def start_epoch(self) -> None:
        """An epoch begins: the meter measures its steps only."""
        self.meter.take()
