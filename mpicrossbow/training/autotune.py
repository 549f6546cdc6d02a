"""Crossbow's learner auto-tuner: how many learners (replicas) per device keep it busy, found by measuring.

Rule (docs/rules.md): start with one learner per device; at every check compare the throughput (samples/s,
summed over ranks) with the previous check; if it rose by more than ``threshold`` add one learner per device,
otherwise drop the learner added last and stop tuning. A ceiling (``max_learners``) ends tuning too.

The tuner is pure logic: :meth:`AutoTuner.observe` takes a measured throughput and returns the learner count
to run next, so it is unit-testable with a scripted sequence. The session checks once per epoch (a change
reshards the data, which is only clean between epochs) with the throughput of that epoch's training steps,
agreed across ranks by one allreduce so every rank makes the same decision. The throughput is measured as
benchmarks/pool.py measures a pool (:class:`StepMeter`): samples over the time of the training steps alone,
the steps of the fused engine's form trial, validations and checkpoints left out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class AutoTuner:
    """Start at ``start`` learners, grow by one while throughput rises by more than ``threshold``."""

    threshold: float = 0.1
    max_learners: int = 16
    start: int = 1
    learners: int = field(init=False)
    frozen: bool = field(default=False, init=False)
    #: (learners, throughput) of every check, in order: the tuner's decision log.
    history: list[tuple[int, float]] = field(default_factory=list, init=False)
    _best: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if not 1 <= self.start <= self.max_learners:
            raise ValueError(f"need 1 <= start <= max_learners, got {self.start} and {self.max_learners}")
        self.learners = self.start
        self.frozen = self.start >= self.max_learners

    def observe(self, throughput: float) -> int:
        """Record the throughput measured with the current count; return the count to use next."""
        if self.frozen:
            return self.learners
        self.history.append((self.learners, throughput))
        previous = self._best
        if previous is None or throughput > previous * (1 + self.threshold):
            self._best = throughput
            if self.learners >= self.max_learners:
                self.frozen = True
                log.info(
                    "auto-tune: %d learner(s) at %.1f samples/s; reached max_learners, frozen",
                    self.learners,
                    throughput,
                )
                return self.learners
            log.info(
                "auto-tune: %d learner(s) at %.1f samples/s%s; trying %d",
                self.learners,
                throughput,
                "" if previous is None else f" (+{throughput / previous - 1:.0%})",
                self.learners + 1,
            )
            self.learners += 1
            return self.learners
        self.frozen = True
        if self.learners > self.start:
            self.learners -= 1
        log.info(
            "auto-tune: %d learner(s) gave %.1f samples/s (%+.0f%%, threshold %.0f%%); frozen at %d",
            self.history[-1][0],
            throughput,
            100 * (throughput / previous - 1),
            100 * self.threshold,
            self.learners,
        )
        return self.learners


@dataclass
class StepMeter:
    """Seconds per training step over one epoch's steady steps: the auto-tuner's measurement.

    A step taken while the pool is :attr:`~mpicrossbow.pool.base.LearnerPool.warming_up` (the fused engine
    timing its forms, which alternates a slower form in) is left out, as are validations and checkpoints
    between steps (not steps): a larger learner count, whose first epoch holds a new trial, is then not
    judged by the trial's speed.
    """

    seconds: float = 0.0
    steps: int = 0

    def add(self, seconds: float, steady: bool) -> None:
        """One training step's ``seconds``, counted when it was ``steady``."""
        if steady:
            self.seconds += seconds
            self.steps += 1

    def take(self) -> float | None:
        """Mean seconds of the steady steps since the last call (None: there was none); starts anew."""
        mean = self.seconds / self.steps if self.steps else None
        self.seconds, self.steps = 0.0, 0
        return mean
