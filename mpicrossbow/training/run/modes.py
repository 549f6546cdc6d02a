"""The three run modes, chosen once per rank from the rule: synchronous, asynchronous, serving.

* **Synchronous** rules (BSP, SMA, EASGD, LocalSGD, DiLoCo, PostLocalSGD): every rank reaches every step,
  so per-epoch statistics are allreduced, validation is collective, checkpoints and the signal stop are
  agreed on.
* **Asynchronous** rules (async EASGD, GOSGD, ASGD, SSP, ...): ranks move at their own pace until
  ``finish``; no collective before it. Statistics stay local, each rank validates alone; after ``finish``
  the samples are summed and rank 0 validates the rule's final model. With checkpoints or the signal stop
  on, ranks pause together for coordinated snapshots (:mod:`.async_checkpoints`) and meet at the end.
* **Serving**: a rank the rule keeps out of training (a parameter server, an EASGD centre) runs the rule's
  ``serve`` loop and reports the served model; after ``finish`` it joins the asynchronous ending (and every
  snapshot's meeting, serving again after each).

Every mode ends the same way: ``finish`` (nothing left in flight), per-rank rates and health, the result.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

from ...comm.base import ReduceOp
from ..health.signals import SignalStop
from ..reporting.result import RunResult
from .async_checkpoints import AsyncCheckpoints
from .loop import LoopOutcome, TrainLoop
from .parts import RankParts


class RunMode(ABC):
    """How one rank runs between ``bind`` and ``finish``, and how it ends."""

    def __init__(self, parts: RankParts) -> None:
        self.parts = parts
        #: Whether :meth:`train` already finished the rule (an asynchronous run's last meeting did).
        self.finished = False

    @abstractmethod
    def train(self) -> LoopOutcome:
        """Everything up to the rule's ``finish``."""

    @abstractmethod
    def conclude(self, outcome: LoopOutcome) -> tuple[float, tuple[float, float]]:
        """After ``finish`` (collectives are safe again): the job's samples and final validation."""

    def run(self) -> RunResult:
        """Train (or serve), finish the rule, record per-rank figures; every rank returns the same result."""
        parts = self.parts
        reporter = parts.reporter
        reporter.restart_clock()
        outcome = self.train()
        busy = reporter.wall
        if not self.finished:
            parts.rule.finish()
        parts.window.settle("the end of training")  # elastic training: the survivors are known
        if parts.timeline is not None:
            parts.timeline.finish(parts.world)
        if parts.trains and busy > 0:
            # the steps this process trained: a resumed run's or a replacement's started part-way
            trained = outcome.steps - outcome.first_step
            reporter.rank_rates(trained / busy, outcome.exchange_s / busy, trained)
        else:
            reporter.rank_rates(math.nan, math.nan)
        reporter.rank_health(parts.rule.in_flight, parts.straggler.injected_seconds)
        samples, val = self.conclude(outcome)
        wall = reporter.wall
        result = RunResult(
            run_dir=str(reporter.run_dir),
            epochs=outcome.epochs,
            steps=outcome.steps,
            train_loss=outcome.train[0],
            train_accuracy=outcome.train[1],
            val_loss=val[0],
            val_accuracy=val[1],
            wall_seconds=wall,
            exchange_seconds=outcome.exchange_s,
            samples_per_second=samples / wall if wall > 0 else 0.0,
            stopped=outcome.stopped,
            train_seconds=outcome.train_s if parts.trains else math.nan,
            target_seconds=outcome.target[0] if outcome.target else math.nan,
            target_epochs=outcome.target[1] if outcome.target else math.nan,
            curve=tuple(outcome.curve),
        )
        reporter.close(
            result, len(parts.pool.learners), {**parts.pool.run_record(), **parts.rule.run_record()}
        )
        return result


class Synchronous(RunMode):
    """Every rank at every step: collective statistics and validation, agreed checkpoints and signals."""

    def train(self) -> LoopOutcome:
        """The loop with allreduced statistics; SIGTERM/SIGUSR1 stop every rank at one step."""
        parts = self.parts
        signals = None
        if parts.checkpoints.saver is not None and parts.config.checkpoint.on_signal:
            signals = SignalStop(parts.comm, parts.world.rank)
        try:
            return TrainLoop(parts, parts.evaluator.collective, self._reduce, signals).run()
        finally:
            if signals is not None:
                signals.close()

    def _reduce(self, stats: Sequence[float]) -> Sequence[float]:
        return self.parts.comm.allreduce_scalars(list(stats))

    def conclude(self, outcome: LoopOutcome) -> tuple[float, tuple[float, float]]:
        """Statistics were summed every epoch; the last validation stands."""
        return outcome.samples, outcome.val


class Asynchronous(RunMode):
    """Ranks at their own pace: local statistics and validation until ``finish``."""

    def train(self) -> LoopOutcome:
        """The loop with this rank's own statistics and validation, pausing for snapshots when they are
        on; then the meetings until the run is over."""
        snapshots = self.snapshots()
        if snapshots is None:
            return TrainLoop(self.parts, self.parts.evaluator.alone, tuple).run()
        try:
            loop = TrainLoop(self.parts, self.parts.evaluator.alone, tuple, snapshots=snapshots)
            outcome = loop.run()
            if not outcome.stopped:
                outcome.stopped = snapshots.until_end(loop.position(0))
            self.finished = True
            snapshots.close()  # after the last meeting: nothing in flight on the control plane
            return outcome
        finally:
            self.close(snapshots)

    def snapshots(self) -> AsyncCheckpoints | None:
        """Coordinated snapshots when this run saves checkpoints (periodic or on a signal), else None."""
        parts = self.parts
        if parts.checkpoints.saver is None:
            return None
        signals = SignalStop(parts.comm, parts.world.rank) if parts.config.checkpoint.on_signal else None
        return AsyncCheckpoints(parts, signals)

    def close(self, snapshots: AsyncCheckpoints) -> None:
        """The signal handlers restored (also when a failure is on its way to abort the job; the control
        plane is freed only after the last meeting, a collective point)."""
        if snapshots.signals is not None:
            snapshots.signals.close()

    def conclude(self, outcome: LoopOutcome) -> tuple[float, tuple[float, float]]:
        """Samples summed over ranks; the run's epochs and steps are the furthest rank's (rank 0 may serve
        and take none: its ``done:`` line and metrics.h5 said 0 of each); rank 0 validates the rule's final
        model for everyone."""
        comm = self.parts.comm
        samples = comm.allreduce_scalars([outcome.samples])[0]
        furthest = comm.allreduce_scalars([float(outcome.epochs), float(outcome.steps)], ReduceOp.MAX)
        outcome.epochs, outcome.steps = int(furthest[0]), int(furthest[1])
        return samples, self.parts.evaluator.final(self.parts.trains)


class Serving(Asynchronous):
    """A rank that serves (a parameter server, an EASGD centre) instead of training."""

    def train(self) -> LoopOutcome:
        """The rule's serve loop; the served model is validated and reported as it goes. With snapshots on,
        the server meets the others whenever every worker drained, and serves again until the end. Between
        sweeps of its requests the loop asks ``[inject]`` whether this rank fails now (by requests served:
        a serving rank takes no steps)."""
        parts = self.parts
        if parts.timeline is not None:
            parts.timeline.serving()
        snapshots = self.snapshots()
        rule, faults = parts.rule, parts.faults

        def tick() -> None:
            if snapshots is not None:
                snapshots.tick()
            faults.at_served(rule.served)

        rule.tick = tick
        try:
            rule.serve(parts.evaluator.served)
            if snapshots is None:
                return LoopOutcome()
            position = {"step": 0, "epoch": 0, "count": 0, "lr": -1.0}
            stopped = snapshots.until_end(position, lambda: rule.serve(parts.evaluator.served))
            self.finished = True
            snapshots.close()
            return LoopOutcome(stopped=stopped)
        finally:
            rule.tick = None
            if snapshots is not None:
                self.close(snapshots)


def choose_mode(parts: RankParts) -> RunMode:
    """The run mode of this rank, decided once from the rule."""
    if not parts.trains:
        return Serving(parts)
    return Synchronous(parts) if parts.rule.synchronous else Asynchronous(parts)
