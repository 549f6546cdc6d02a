"""Crossbow's learner auto-tuner: how many learners (replicas) per device keep it busy, found by measuring.

Rule (docs/rules.md): start with one learner per device; at every check compare the throughput (samples/s,
summed over ranks) with the previous check; if it rose by more than ``threshold`` add one learner per device,
otherwise drop the learner added last and stop tuning. A ceiling (``max_learners``) ends tuning too.

The tuner is pure logic: :meth:`AutoTuner.observe` takes a measured throughput and returns the learner count
to run next, so it is unit-testable with a scripted sequence. The session checks once per epoch (a change
reshards the data, which is only clean between epochs) with the throughput of that epoch's training steps,
agreed across ranks by one allreduce so every rank makes the same decision.
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
