"""The training loop of a rank that trains: epochs of :func:`~.step.train_step`, from a resumed position.

Per step: the watchdog's heartbeat, the learning-rate schedule (per step, with the rule's
``on_lr_change``), the step itself with the NaN guard, the straggler hook, step checkpoints and the signal
stop, each step run by the run's :class:`~.window.StepWindow` (which commits it in elastic training,
fires a drill). Per epoch: training statistics (reduced as the run mode says), validation as often as
``validate_every`` asks, a report row, the auto-tuner, epoch checkpoints. The run mode
(:mod:`.modes`) chooses how statistics are reduced, how validation is done and whether signals are agreed on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...trace import span
from ..health.signals import SIGNAL_CHECK_STEPS, SignalStop
from ..tuning.noise_scale import NoiseScale
from .async_checkpoints import AsyncCheckpoints
from .evaluation import per_sample
from .learner_tuning import LearnerTuning
from .nan_guard import NanGuard
from .parts import RankParts
from .schedule import lr_at
from .step import train_step
from .validations import NAN2, Validations


@dataclass
class LoopOutcome:
    """Where a loop ended and what it measured."""

    epochs: int = 0
    steps: int = 0
    #: The step this process's loop started at (a resume's, or a replacement's join): ``steps`` less this is
    #: what it trained itself.
    first_step: int = 0
    train: tuple[float, float] = NAN2
    val: tuple[float, float] = NAN2
    exchange_s: float = 0.0
    samples: float = 0.0
    #: A signal stopped training early (every rank saved a checkpoint first).
    stopped: bool = False
    #: ``(training seconds, epochs, validation accuracy)`` of every validation (:mod:`.validations`).
    curve: list[tuple[float, float, float]] = field(default_factory=list)
    #: ``(training seconds, epochs)`` when ``[session] target_accuracy`` was first reached, or None.
    target: tuple[float, float] | None = None
    #: Seconds of the loop's steps, validations left out (:attr:`.validations.Validations.training_seconds`).
    train_s: float = 0.0


class TrainLoop:
    """Runs the epochs; ``validate`` and ``reduce`` (of per-epoch ``(loss_sum, hits, n)``) come from the
    run mode, ``signals`` is the agreed stop on SIGTERM/SIGUSR1 or None; an asynchronous run's
    ``snapshots`` (then ``signals`` is None) take its checkpoints and its signal stop instead."""

    def __init__(
        self,
        parts: RankParts,
        validate: Callable[[], tuple[float, float]],
        reduce: Callable[[Sequence[float]], Sequence[float]],
        signals: SignalStop | None = None,
        snapshots: AsyncCheckpoints | None = None,
    ) -> None:
        self.parts, self.validate, self.reduce = parts, validate, reduce
        self.signals: Callable[[int], bool] | None = signals
        #: How steps and the collectives between them run (committed, in elastic training).
        self.window = window = parts.window
        self.validate = window.collective(validate, "validation")
        self.reduce = window.collective(reduce, "the epoch's statistics")
        if signals is not None:
            window.on_recovery(signals.forget_pending)
            self.signals = self._committed_checks(signals)
        self.snapshots = snapshots
        cfg, pool = parts.config, parts.pool
        self.budget = cfg.session.steps
        # With a step budget the epoch count follows from it; the auto-tuner may change steps per epoch.
        self.epochs = math.ceil(self.budget / pool.n_batch_train) if self.budget else cfg.session.epochs
        position = parts.checkpoints.position
        self.epoch, self.step = int(position.get("epoch", 0)), int(position.get("step", 0))
        self.skip, self.lr = int(position.get("count", 0)), float(position.get("lr", -1.0))
        self.saved_at = self.step if parts.checkpoints.resume is not None else -1
        self.out = LoopOutcome(first_step=self.step)
        self.at_epochs = float(self.epoch)  # epochs done, with the current one's fraction
        where = pool.learners[0].params.device
        settle = (lambda: torch.cuda.synchronize(where)) if where.type == "cuda" else None
        self.checks = Validations(
            self.validate, cfg.session.validate_every, cfg.session.target_accuracy, settle
        )
        #: The auto-tuner's checks (``[pool] learners = auto``), else None.
        self.tuning = LearnerTuning(parts, parts.tuner) if parts.tuner is not None else None
        #: The gradient noise scale, measured around the rule's ``on_gradients`` (continued on a resume).
        self.noise = NoiseScale(cfg.session.noise_scale_every, cfg.session.noise_scale_smoothing)
        self.noise.load_state_dict(position.get("noise_scale", {}))
        batch = cfg.data.batch_size
        parts.rule.on_noise_scale(lambda: self.noise.value(batch))
        #: ``[session] on_nan`` after each step's backward (deferred on a CUDA device: no wait per step).
        self.nan_guard = NanGuard(cfg.session.on_nan)
        size = parts.world.size
        #: Ranks that train (a parameter server's or an asynchronous centre's rank does not).
        self.trainers = sum(parts.rule.trains(rank, size) for rank in range(size))

    def _committed_checks(self, signals: SignalStop) -> Callable[[int], bool]:
        """The signal check as the window's collective at the steps it communicates (every
        SIGNAL_CHECK_STEPS), a local call at the others (in elastic training a commit there would end the
        open window at every step)."""
        committed = self.window.collective(signals, "the signal check")

        def check(step: int) -> bool:
            return committed(step) if step % SIGNAL_CHECK_STEPS == 0 else signals(step)

        return check

    def run(self) -> LoopOutcome:
        """Train to the step or epoch budget, or until a signal stops every rank (after a checkpoint)."""
        parts, ckpt = self.parts, self.parts.config.checkpoint
        parts.reporter.open_bar(
            self.budget or self.epochs * parts.pool.n_batch_train, self.step, self._samples_per_step()
        )
        self.checks.start()
        while (
            self.epoch < self.epochs and (not self.budget or self.step < self.budget) and not self.checks.done
        ):
            if self._epoch():
                self.nan_guard.flush()
                self.out.val, self.out.stopped = self.validate(), True
                return self._outcome()
            self.skip = 0
        if ckpt.enabled and ckpt.final and self.saved_at != self.step and self.snapshots is None:
            self._save(0)
        parts.reporter.close_bar()
        return self._outcome()

    def _outcome(self) -> LoopOutcome:
        self.out.epochs, self.out.steps = self.epoch, self.step
        self.out.curve, self.out.target = list(self.checks.curve), self.checks.reached
        self.out.train_s = self.checks.training_seconds
        return self.out

    def _epoch(self) -> bool:
        """One epoch from batch ``skip``; True when a signal stopped training."""
        parts, ckpt = self.parts, self.parts.config.checkpoint
        pool, per_epoch = parts.pool, parts.pool.n_batch_train
        pool.start_epoch(self.epoch)
        pool.set_lr(self._lr_at(self.epoch) if self.lr < 0 else self.lr, self.epoch)
        if self.skip:
            pool.skip(self.skip)
        pool.take_data_wait()  # from this epoch's first step on
        if self.tuning is not None:
            self.tuning.start_epoch()  # the auto-tuner measures this epoch's steps
        started = time.perf_counter()
        end = min(per_epoch, self.skip + self.budget - self.step) if self.budget else per_epoch
        for count in range(self.skip, end):
            self._step(count, per_epoch)
            self.at_epochs = self.epoch + (count + 1) / per_epoch
            if self.checks.due_within_epoch(count + 1, per_epoch):
                parts.rule.on_pause()
                self._beat("validate")
                with span("validation", "validation"):
                    self.checks.run(self.step, self.at_epochs)
                if self.checks.done:
                    break
            if self.snapshots is not None:
                if self.snapshots.due(self.step) and self.snapshots.pause(self.position(count + 1)):
                    return True
                continue
            if ckpt.every_steps and self.step % ckpt.every_steps == 0:
                self._save(count + 1)
            if self.signals is not None and self.signals(self.step):
                if self.saved_at != self.step:
                    self._save(count + 1)
                saver = parts.checkpoints.saver
                parts.reporter.stopped_by_signal(self.step, saver.directory if saver else None)
                return True
        self._end_epoch(time.perf_counter() - started)
        return False

    def _step(self, count: int, per_epoch: int) -> None:
        parts = self.parts
        self.window.before_step(lambda: self.position(count))
        started, steady = time.perf_counter(), not parts.pool.warming_up
        self._beat("compute")
        timeline = parts.timeline
        if timeline is not None:
            timeline.before_step(self.step)
        lr = self._lr_at(self.epoch + count / per_epoch)
        if lr != self.lr:
            if self.lr > 0:
                parts.rule.on_lr_change(self.lr, lr)
            parts.pool.set_lr(lr, self.epoch)
            self.lr = lr
            self.window.amend()  # elastic: a step dropped later keeps the new rate

        def run() -> float:
            return train_step(parts.pool, parts.rule, self.step, count, self._guard, self.noise, self.window)

        exchange_s = self.window.step(run, self.step)
        self.out.exchange_s += exchange_s
        if timeline is not None and timeline.recording:
            timeline.exchange_s += exchange_s
        self.step += 1
        parts.reporter.step_done(self.step)
        parts.straggler.after_step(started, self.step - 1, parts.comm.size)
        if self.tuning is not None:  # a straggler's sleep is its slowness
            self.tuning.meter.add(time.perf_counter() - started, steady)

    def _lr_at(self, epoch: float) -> float:
        """The schedule's rate at ``epoch`` for the learners training now (``[optim] lr_scaling`` scales by
        them; the auto-tuner may have changed their count since the last step)."""
        learners = self.trainers * len(self.parts.pool.learners)
        return lr_at(self.parts.config.optim, epoch, learners)

    def _guard(self, step: int) -> None:
        """Between backward and the rule's hooks: the NaN policy, then the watchdog's exchange phase."""
        parts = self.parts
        self.nan_guard.check(parts.pool, parts.faults, step, self.epoch)
        self._beat("exchange")

    def _beat(self, phase: str) -> None:
        """Tell the watchdog (if any) where this rank is: ``phase`` of the current step."""
        if self.parts.watchdog is not None:
            self.parts.watchdog.beat(self.step, phase)

    def _end_epoch(self, seconds: float) -> None:
        """Statistics, validation, the report row, the auto-tuner and epoch checkpoints (the epoch may end
        early: the target accuracy was reached)."""
        parts = self.parts
        parts.rule.on_pause()
        self.nan_guard.flush()  # the epoch's last steps' NaN checks, before its statistics and checkpoints
        self._beat("validate")
        learners = len(parts.pool.learners)
        waited = parts.pool.take_data_wait() / seconds if seconds > 0 else 0.0
        loss_sum, hits, n = self.reduce(parts.pool.take_stats())
        self.out.samples += n
        self.out.train = per_sample(loss_sum, hits, n)
        last = self.epoch == self.epochs - 1 or bool(self.budget and self.step >= self.budget)
        last = last or self.checks.done  # reached at a validation within this epoch
        due = self.checks.due_at_epoch_end(self.epoch, last)
        with span("validation", "validation"):
            val = self.checks.run(self.step, self.at_epochs) if due else None
        self.out.val = val if val is not None else self.out.val
        last = last or self.checks.done  # reached at this epoch's end
        noise_scale = self.noise.value(parts.config.data.batch_size)
        parts.reporter.epoch(
            self.epoch,
            self.step,
            self.lr,
            learners,
            self.out.train,
            val,
            (self.out.exchange_s, waited),
            noise_scale,
        )
        if self.tuning is not None and not last and self.tuning.check(n, seconds, noise_scale):
            self._resized()
        self.epoch += 1
        every_epochs = parts.config.checkpoint.every_epochs
        periodic = every_epochs and self.epoch % every_epochs == 0 and self.snapshots is None
        if periodic and self.saved_at != self.step and not last:
            self._save(0)

    def _resized(self) -> None:
        """The auto-tuner changed the learners, so the steps of an epoch: the epoch count of a step budget,
        or the progress bar's total."""
        per_epoch = self.parts.pool.n_batch_train
        if self.budget:
            self.epochs = self.epoch + 1 + math.ceil((self.budget - self.step) / per_epoch)
        else:
            steps_left = (self.epochs - self.epoch - 1) * per_epoch
            self.parts.reporter.set_bar_total(steps_left, self._samples_per_step())

    def _samples_per_step(self) -> int:
        """Samples one step trains over every rank (rank 0's learners × batch size × ranks)."""
        parts = self.parts
        return len(parts.pool.learners) * parts.config.data.batch_size * parts.world.size

    def position(self, count: int) -> dict[str, Any]:
        """Where training stands after the current step, ``count`` batches of the current epoch done: what a
        checkpoint records to resume from."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "count": count,
            "lr": self.lr,
            "noise_scale": self.noise.state_dict(),
            **({"tuner": self.parts.tuner.state_dict()} if self.parts.tuner is not None else {}),
        }

    def _save(self, count: int) -> None:
        """A checkpoint after the current step (``count`` batches of the current epoch done)."""
        parts = self.parts
        parts.rule.on_pause()
        self._beat("save")
        # a checkpoint holds final steps only; committed here, outside the checkpoint's span (the
        # collective below then finds no window open)
        self.window.flush("the checkpoint")
        # elastic: a committed collective, saved again over the survivors when a rank is lost during it
        save = self.window.collective(parts.checkpoints.save, "the checkpoint")
        with span("checkpoint", "checkpoint"):
            save(self.position(count), parts.rule, parts.faults)
        self.saved_at = self.step
