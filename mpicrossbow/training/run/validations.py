"""When the training loop validates, on a clock that leaves validation out, and when a target is reached.

``[session] validate_every`` counts epochs: a whole number validates after every that many epochs, a
fraction below 1 that many times an epoch (0.25: four times, at the nearest steps, and after every epoch).
``[session] target_accuracy`` (above 0) ends training at the first validation at or above it: the time to
accuracy that Crossbow's claim is about. The training clock runs from the loop's first step and stops
while a validation runs, so ``time to target`` is training time alone, comparable between engines whose
validations cost differently. Every validation is one point of the run's ``curve``. On a device that runs
asynchronously (CUDA) the clock stops only once the device has finished the steps queued before the
validation (``settle``), so no training step is counted as validation.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

NAN2 = (math.nan, math.nan)


class Validations:
    """The loop's validations: ``due_*`` say when, :meth:`run` validates (once per step at most), records
    ``(training seconds, epochs, accuracy)`` in :attr:`curve` and notes when ``target`` is first reached."""

    def __init__(
        self,
        validate: Callable[[], tuple[float, float]],
        every: float,
        target: float,
        settle: Callable[[], object] | None = None,
    ) -> None:
        self._validate, self.every, self.target = validate, every, target
        #: Waits for the device's queued training work (``torch.cuda.synchronize`` on CUDA), or None.
        self._settle = settle
        #: ``(training seconds, epochs done, validation accuracy)`` of every validation, in order.
        self.curve: list[tuple[float, float, float]] = []
        #: ``(training seconds, epochs done)`` at the first validation at or above the target, or None.
        self.reached: tuple[float, float] | None = None
        self._started, self._paused = time.perf_counter(), 0.0
        self._step, self._last = -1, NAN2

    def start(self) -> None:
        """Start the training clock (the loop's first step)."""
        self._started, self._paused = time.perf_counter(), 0.0

    @property
    def training_seconds(self) -> float:
        """Seconds since :meth:`start`, validations left out."""
        return time.perf_counter() - self._started - self._paused

    @property
    def done(self) -> bool:
        """The target is set and reached: training ends."""
        return self.target > 0 and self.reached is not None

    def due_within_epoch(self, done: int, per_epoch: int) -> bool:
        """Whether to validate after ``done`` batches of an epoch of ``per_epoch`` (the epoch's end is
        :meth:`due_at_epoch_end`'s)."""
        if not 0 < self.every < 1 or done >= per_epoch:
            return False
        interval = max(1, round(self.every * per_epoch))
        return done % interval == 0

    def due_at_epoch_end(self, epoch: int, last: bool) -> bool:
        """Whether to validate after epoch ``epoch`` (0-based); always after the last."""
        if last or 0 < self.every < 1:
            return True
        return bool(self.every) and (epoch + 1) % round(self.every) == 0

    def run(self, step: int, epochs: float) -> tuple[float, float]:
        """Validate after ``step`` steps (``epochs`` epochs, fractional) unless that step was validated
        already; (loss, accuracy)."""
        if step == self._step:
            return self._last
        if self._settle is not None:
            self._settle()  # the steps queued so far are training time
        paused = time.perf_counter()
        self._last, self._step = self._validate(), step
        self._paused += time.perf_counter() - paused
        seconds, accuracy = self.training_seconds, self._last[1]
        self.curve.append((seconds, epochs, accuracy))
        if self.target > 0 and self.reached is None and accuracy >= self.target:
            self.reached = (seconds, epochs)
            log.info(
                "target accuracy %.4f reached: %.4f at epoch %.2f (step %d) after %.2f s of training",
                self.target,
                accuracy,
                epochs,
                step,
                seconds,
            )
        return self._last
