"""Crossbow's learner auto-tuner: how many learners (replicas) per rank train fastest, found by measuring.

Two rules (``[pool] tune``, docs/pools.md "Auto-tuning the learner count"):

* ``throughput`` (Crossbow's): start with one learner per rank; at every check compare the throughput
  (samples/s, summed over ranks) with the best so far; if it rose by more than ``threshold`` add one learner
  per rank, otherwise drop back to the best count and stop tuning. A ceiling (``max_learners``) ends tuning
  too.
* ``goodput`` (Pollux's, Qiao et al., OSDI 2021): the same climb, judged by the goodput = throughput ×
  statistical efficiency instead. With m learners per rank the global batch is B(m) = m × ``unit_batch``
  (``unit_batch``: the samples of one learner per rank, ranks that train × batch size) and

      E(m) = (B_noise + B₀) / (B_noise + B(m)),   B₀ = B(start),

  the share of a sample's progress a batch of B(m) keeps compared with the starting batch (McCandlish et
  al.'s model of large-batch training; B_noise is the gradient noise scale, :mod:`.noise_scale`). Every
  comparison re-scores the throughputs measured so far with the *latest* B_noise, so counts measured
  early are judged by what is known now. Once settled, the measured throughputs are kept and only a new
  B_noise moves the choice: it may grow again to a larger measured count (B_noise usually rises as the
  loss falls) or shrink to a smaller one, when that count's goodput beats the current one by more than
  ``threshold``. It never grows past the counts it measured while probing: a throughput model that let it
  (a step's time fitted as a + b·m, as Pollux predicts batch sizes it has not run) grew SMA on MNIST-1D to
  4-5 learners after the first lr decay, where B_noise is several times its early value, and 2 of 3 seeds
  then missed 94 % that 2 and 3 fixed learners reached (benchmarks/results/goodput.md): B_noise models a
  larger batch's cost in samples, not the accuracy a model average of more learners ends at.

  **Where it starts** (:func:`start_count`): at the smallest count whose steps measure B_noise — one learner
  per rank under a rule that averages gradients over 2+ ranks (BSP's grad mode), two otherwise (SMA, EASGD,
  LOCALSGD: a rank's own learners are the big batch). Starting at one learner there would spend a whole
  epoch at the slowest count learning nothing about efficiency: on MNIST-1D under SMA (2 ranks, fused,
  batch 16) that epoch took as long as 3.6 epochs at four learners, about a tenth of the run to 94 %
  (benchmarks/results/goodput.md). **While B_noise is unknown** (NaN, before the first estimate), the
  efficiency is taken as 1: the goodput rule then decides as the throughput rule does, and the first
  B_noise measured re-scores the counts already tried.

The tuner is pure logic: :meth:`AutoTuner.observe` takes a measured throughput and B_noise and returns the
learner count to run next, so it is unit-testable with scripted sequences. Its state (count, measurements,
history, best, frozen) travels in checkpoints (:meth:`AutoTuner.state_dict`); the loop's side of a check
(measuring, agreeing across ranks, resizing) is :mod:`.learner_tuning`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

#: The tuners' names (``[pool] tune``).
TUNES = ("goodput", "throughput")


def start_count(tune: str, averages_gradients: bool, trainers: int, max_learners: int) -> int:
    """The learners per rank the tuner starts with: Crossbow's one for ``tune = throughput``; for ``goodput``
    the smallest count whose steps measure B_noise (module docstring): 1 where the rule averages gradients
    over ``trainers`` >= 2 ranks, else 2 (never past ``max_learners``)."""
    if tune == "throughput" or (averages_gradients and trainers >= 2):
        return 1
    return min(2, max_learners)


def efficiency(noise_scale: float, batch: float, base: float) -> float:
    """Statistical efficiency of global batch ``batch`` against ``base``: (B_noise + B₀)/(B_noise + B), the
    progress per sample relative to the base batch; 1 where ``noise_scale`` is unknown (NaN) or not
    positive."""
    if not math.isfinite(noise_scale) or noise_scale <= 0:
        return 1.0
    return (noise_scale + base) / (noise_scale + batch)


@dataclass
class AutoTuner:
    """Start at ``start`` learners per rank, grow by one while the goodput (or, ``tune = throughput``, the
    throughput) rises by more than ``threshold``; ``unit_batch`` is the global batch of one learner per
    rank (ranks that train × batch size), which scales B_noise against the learner count."""

    threshold: float = 0.1
    max_learners: int = 16
    start: int = 1
    tune: Literal["goodput", "throughput"] = "goodput"
    unit_batch: int = 1
    learners: int = field(init=False)
    #: Probing has ended (the goodput rule may still move among measured counts as B_noise changes).
    frozen: bool = field(default=False, init=False)
    #: ``(learners, throughput, B_noise, efficiency, goodput)`` of every check, in order: the decision log
    #: (efficiency 1 and goodput = throughput for the throughput rule or while B_noise is unknown).
    history: list[tuple[int, float, float, float, float]] = field(default_factory=list, init=False)
    #: The throughput last measured at each learner count while probing (samples/s).
    rates: dict[int, float] = field(default_factory=dict, init=False)
    #: The latest finite B_noise (samples), NaN before the first.
    noise_scale: float = field(default=math.nan, init=False)
    #: The count with the best score so far (None before the first check).
    best: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if not 1 <= self.start <= self.max_learners:
            raise ValueError(f"need 1 <= start <= max_learners, got {self.start} and {self.max_learners}")
        if self.tune not in TUNES:
            raise ValueError(f"tune must be one of {', '.join(TUNES)}, got {self.tune!r}")
        if self.unit_batch < 1:
            raise ValueError(f"unit_batch must be >= 1, got {self.unit_batch}")
        self.learners = self.start
        self.frozen = self.start >= self.max_learners

    def efficiency(self, learners: int) -> float:
        """E(learners) at the latest B_noise (1 for the throughput rule or while B_noise is unknown)."""
        if self.tune == "throughput":
            return 1.0
        return efficiency(self.noise_scale, learners * self.unit_batch, self.start * self.unit_batch)

    def score(self, learners: int) -> float:
        """The goodput (throughput rule: the throughput) of a measured count at the latest B_noise."""
        return self.rates[learners] * self.efficiency(learners)

    def observe(self, throughput: float, noise_scale: float = math.nan) -> int:
        """Record the throughput measured with the current count and the latest smoothed B_noise (NaN:
        unknown); return the learner count to use next."""
        if self.tune == "goodput" and math.isfinite(noise_scale) and noise_scale > 0:
            self.noise_scale = noise_scale
        m = self.learners
        if self.frozen:
            return self._settled(m, throughput)
        self.rates[m] = throughput
        self._record(m, throughput)
        previous = self.best
        if previous is None or self.score(m) > self.score(previous) * (1 + self.threshold):
            self.best = m
            if m >= self.max_learners:
                self.frozen = True
                self._say("reached max_learners, frozen at %d", m)
                return m
            self.learners = m + 1
            self._say("trying %d", self.learners)
            return self.learners
        self.frozen = True
        self.learners = previous
        self._say(
            "%s not %.0f%% above that of %d learner(s); frozen at %d",
            "goodput" if self.tune == "goodput" else "throughput",
            100 * self.threshold,
            previous,
            previous,
        )
        return self.learners

    def _settled(self, m: int, throughput: float) -> int:
        """After probing: the throughput rule keeps its count; the goodput rule moves to the measured count
        whose goodput at the latest B_noise beats the current one's by more than ``threshold``."""
        if self.tune == "throughput" or m not in self.rates:
            return m
        self._record(m, throughput)
        target = max(self.rates, key=self.score)
        if target != m and self.score(target) > self.score(m) * (1 + self.threshold):
            self.best = self.learners = target
            self._say(
                "B_noise moved the best count: %s to %d", "growing" if target > m else "shrinking", target
            )
        return self.learners

    def _record(self, m: int, throughput: float) -> None:
        """One row of the decision log at the current B_noise."""
        e = self.efficiency(m)
        self.history.append((m, throughput, self.noise_scale, e, throughput * e))

    def _say(self, decision: str, *args: object) -> None:
        """Log the last check with both factors, then the decision."""
        m, throughput, noise, e, goodput = self.history[-1]
        if self.tune == "throughput":
            head = f"auto-tune (throughput): {m} learner(s) at {throughput:.1f} samples/s; "
        else:
            head = (
                f"auto-tune (goodput): {m} learner(s): throughput {throughput:.1f} samples/s × efficiency "
                f"{e:.3f} (B_noise {noise:.4g}) = goodput {goodput:.1f}; "
            )
        log.info(head + decision, *args)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs to continue tuning where it stopped (plain Python values)."""
        return {
            "tune": self.tune,
            "learners": self.learners,
            "frozen": self.frozen,
            "best": self.best,
            "noise_scale": self.noise_scale,
            "rates": [[m, t] for m, t in sorted(self.rates.items())],
            "history": [list(row) for row in self.history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (an empty mapping: start afresh). A checkpoint of the other rule
        is refused: its measurements mean something else."""
        if not state:
            return
        if state["tune"] != self.tune:
            raise ValueError(f"the checkpoint's tuner is tune = {state['tune']}, this job's {self.tune}")
        learners = int(state["learners"])
        if not 1 <= learners <= self.max_learners:
            raise ValueError(f"the checkpoint's tuner runs {learners} learner(s), past max_learners")
        self.learners, self.frozen = learners, bool(state["frozen"])
        self.best = None if state["best"] is None else int(state["best"])
        self.noise_scale = float(state["noise_scale"])
        self.rates = {int(m): float(t) for m, t in state["rates"]}
        self.history = [
            (int(r[0]), float(r[1]), float(r[2]), float(r[3]), float(r[4])) for r in state["history"]
        ]
