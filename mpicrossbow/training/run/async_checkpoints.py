"""Checkpoints of asynchronous runs: a coordinated snapshot, taken while every rank keeps its own pace.

Asynchronous rules (async EASGD, GOSGD, the parameter servers) have no step every rank reaches, so a
checkpoint is a pause that every rank joins (the protocol is :mod:`.pause_orders`'s):

1. **When.** A training rank orders a snapshot when its own step count reaches ``[checkpoint] every_steps``
   (or ``every_epochs`` of its own batches) past the last snapshot, or when it caught SIGTERM/SIGUSR1; a
   serving rank orders one when it caught a signal. Every training rank probes for orders after each step.
2. **Drain.** A pausing rank runs its rule's :meth:`~mpicrossbow.rules.base.Rule.finish` — the same
   termination protocol the run ends with: a worker's last push is answered, a server serves until every
   worker has drained, gossip peers exchange goodbyes — so every message in flight is delivered, none dropped:
   no push is counted twice or lost at a server, and GOSGD's gossip weights sum to 1 in the saved state.
3. **Meet and save.** Every rank meets (the ranks whose training ended are waiting there already), and all
   save into the synchronous rules' atomic layout, named after the largest step any rank took; each rank's
   own position (step, epoch, batches done) is in its file, so ``--resume`` restarts each where it paused.
4. **Go on or stop.** After a signal every rank stops (the job exits with status 75 and is requeued under
   Slurm, as for every rule); otherwise every rank re-arms its rule
   (:meth:`~mpicrossbow.rules.base.Rule.rearm`) and goes on at its own pace.

A rank whose training has ended keeps meeting until no rank has training left; the last meeting is the
run's end (and its final checkpoint, with ``final = true`` and periodic checkpoints on).

In elastic training (``[elastic] enabled``) the control plane and the save run over a fault-tolerant group of
their own (the run's window gives it, :meth:`~.window.StepWindow.pause_orders`;
:mod:`mpicrossbow.training.elastic.elastic_pause`): a lost worker is left out of the meeting and of the
snapshots after it; a lost server or EASGD centre ends the job in one line with the last complete snapshot
intact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..checkpoints.pause_orders import Meeting, PauseOrders
from ..health.signals import SignalStop
from .parts import RankParts

log = logging.getLogger(__name__)


class AsyncCheckpoints:
    """One asynchronous rank's snapshots: whether to pause after a step, and the pause itself."""

    def __init__(self, parts: RankParts, signals: SignalStop | None) -> None:
        self.parts, self.signals = parts, signals
        #: The control plane: fault tolerant over the survivors in elastic training, else a plain one.
        self.orders: PauseOrders = parts.window.pause_orders(parts.world)
        ckpt = parts.config.checkpoint
        #: This rank's own steps between snapshots (0: only signals take one).
        self.every = ckpt.every_steps or ckpt.every_epochs * parts.pool.n_batch_train
        #: Whether periodic checkpoints are on (the run's end then saves too, when ``final``).
        self.periodic = ckpt.enabled
        #: The step of the last snapshot (the resumed one at first).
        self.last = parts.checkpoints.resume_step or 0
        #: AsyncCheckpoints taken by this run.
        self.taken = 0

    @property
    def signalled(self) -> bool:
        """Whether this rank caught SIGTERM/SIGUSR1."""
        return self.signals is not None and self.signals.received is not None

    def tick(self) -> None:
        """A serving rank's poll between requests: order a snapshot once it caught a signal."""
        if self.signals is not None:
            self.signals.touch()
        if self.signalled:
            self.orders.order(stop=True)

    def due(self, step: int) -> bool:
        """After a training rank's ``step``: whether it pauses now — its own interval or signal (then it
        orders the snapshot), or another rank's order; the rule may widen the decision to its group."""
        if self.signals is not None:
            self.signals.touch()
        if self.signalled or (self.every and step >= self.last + self.every):
            self.orders.order(stop=self.signalled)
        wanted = self.orders.ordered or self.orders.pending()
        return self.parts.rule.agree_pause(wanted)

    def pause(self, position: dict[str, Any]) -> bool:
        """A training rank's pause after a step: drain, meet, save; True when every rank stops (a signal),
        else the rule is re-armed and training goes on."""
        self.parts.rule.finish()
        meeting = self.meet(position, training_left=True)
        if meeting.stop:
            return True
        self.parts.rule.rearm()
        return False

    def until_end(self, position: dict[str, Any], work: Callable[[], None] | None = None) -> bool:
        """A rank with no training left (a worker after its last step, a server after serving): drain and
        meet, again after every snapshot the others take (``work`` first: a server serves again), until the
        run is over; True when a signal stopped it."""
        while True:
            self.parts.rule.finish()
            meeting = self.meet(position, training_left=False)
            if meeting.stop:
                return True
            if not meeting.training:
                return False
            self.parts.rule.rearm()
            if work is not None:
                work()

    def meet(self, position: dict[str, Any], training_left: bool) -> Meeting:
        """Collective: meet every rank, save when the meeting takes a snapshot (or ends a run that saves
        periodically, with ``final``)."""
        meeting = self.orders.meet(
            self.signalled, training_left, int(position["step"]), lambda met: self._save_if(met, position)
        )
        if meeting.stop:
            if self.signals is not None:
                self.signals.agree()
            saver = self.parts.checkpoints.saver
            self.parts.reporter.stopped_by_signal(meeting.step, saver.directory if saver else None)
        return meeting

    def _save_if(self, meeting: Meeting, position: dict[str, Any]) -> None:
        """Save when the meeting takes a snapshot (or ends a run that saves periodically, with ``final``)."""
        final = not meeting.training and self.periodic and self.parts.config.checkpoint.final
        if meeting.snapshot or (final and meeting.step != self.last):
            self._save(meeting, position)

    def _save(self, meeting: Meeting, position: dict[str, Any]) -> None:
        parts = self.parts
        path = parts.checkpoints.save(position, parts.rule, parts.faults, step=meeting.step)
        self.last, self.taken = meeting.step, self.taken + 1
        if self.orders.leader:
            why = "signal" if meeting.stop else f"{meeting.orders} rank(s) asked" if meeting.orders else "end"
            log.info("asynchronous snapshot at step %d (%s): %s", meeting.step, why, path)

    def close(self) -> None:
        """Free the control plane (after the last meeting)."""
        self.orders.close()
