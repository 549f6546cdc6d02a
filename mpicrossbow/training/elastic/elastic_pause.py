"""Coordinated snapshots in elastic training: the pause orders and the meeting, fault tolerant.

An asynchronous run with ``[elastic] enabled`` loses workers and goes on (a parameter server or EASGD centre
forgets a lost worker, GOSGD peers forget a lost peer); its snapshots must go on too. Here the control plane
of :mod:`.pause_orders` runs over a fault-tolerant group of its own, split from the run's
:class:`~mpicrossbow.comm.elastic.ElasticCommunicator` at start, and the snapshot is saved over that group:

* **Orders** go to the group's members; a send to a lost rank is dropped, and a probe for orders that meets a
  known failure acknowledges it (``MPI_Comm_ack_failed``) and probes on: the meeting is where a loss counts.
* **The meeting** (and the save, which is part of it) is tried over the members; every member then agrees
  (``MPI_Comm_agree``) that it completed everywhere. When it did not — a member was lost before or during
  it — the survivors revoke the group, shrink it to the live members and meet again (the orders sent over
  the old group are abandoned with it), as
  :meth:`~mpicrossbow.training.elastic.fault_tolerance.FaultTolerance.collective`
  retries a collective. The lowest survivor logs one line naming the lost start ranks.
* **A lost worker**: the snapshot, and every one after it, holds the survivors' files, each named after its
  start rank (``rank-00003.pt`` stays rank 3's), with the lost start ranks in ``meta.pt`` (``lost``). Such a
  snapshot is not resumable — the lost rank's state is gone — and ``--resume`` of it is one line saying so
  (:func:`~mpicrossbow.training.checkpoints.checkpoint_files.load_rank_state`); resuming the run takes the
  newest snapshot before the loss, which pruning keeps
  (:func:`~mpicrossbow.training.checkpoints.checkpoint_files.newest_whole`).
* **A lost serving rank** (a parameter server, the EASGD centre: the model lives there) — unless the rule
  still holds the model (a parameter server's backup took over, ``Rule.model_survives``) — ends the job with
  :class:`~mpicrossbow.comm.ulfm.ElasticEnd` before anything is saved, so the last complete snapshot stays
  as it was on disk (a save cut short leaves only a ``.partial`` folder, never loaded). The lowest
  surviving worker says so; the others wait for its abort.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from ...comm.elastic import ElasticCommunicator, until_committed
from ...comm.ulfm import ElasticEnd, is_process_failure
from ..checkpoints.checkpoint_files import Checkpointer, complete_checkpoints
from ..checkpoints.pause_orders import Meeting, PauseOrders, order_tag
from ..run.parts import RankParts

log = logging.getLogger(__name__)


class ElasticPauseOrders(PauseOrders):
    """One rank's end of an elastic run's control plane: orders, a meeting retried over the survivors, and
    the snapshot saved over them."""

    def __init__(self, parts: RankParts, comm: ElasticCommunicator) -> None:
        group = comm.group.split(0)  # collective at start: every rank builds its snapshots there
        super().__init__(parts.world, control=group.native)
        self.parts, self.group = parts, group
        #: The members' start ranks (COMM_WORLD's), in the group's rank order.
        self.ranks = group.start_ranks()
        #: This rank's start rank (its checkpoint file's name).
        self.start_rank = self.ranks[self.control.Get_rank()]
        trains = self.control.allgather(bool(parts.trains))
        #: Start ranks that serve (a parameter server, the EASGD centre): losing one ends the job.
        self.serving = frozenset(r for r, t in zip(self.ranks, trains, strict=True) if not t)
        #: Start ranks lost so far, as the meetings found them.
        self.lost: tuple[int, ...] = ()
        #: Start ranks the meeting under way lost (said once it succeeded over the survivors).
        self._gone: tuple[int, ...] = ()
        self._use_saver()

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for the meeting: the lowest member."""
        return self.control is not None and self.control.Get_rank() == 0

    def _use_saver(self) -> None:
        """Save checkpoints over the members (collective: the saver's first barrier), files named by start
        rank, the lost ranks in ``meta.pt``."""
        checkpoints = self.parts.checkpoints
        saver = checkpoints.saver
        if saver is None:
            return
        checkpoints.saver = Checkpointer(
            saver.directory,
            self.control.Get_rank(),
            self.control.Get_size(),
            saver.keep,
            self.control,
            file_rank=self.start_rank,
            lost=self.lost,
        )

    def _send(self, message: np.ndarray, peer: int) -> None:
        """Start sending an order; a peer known lost is skipped (the meeting leaves it out)."""
        try:
            super()._send(message, peer)
        except Exception as exc:
            if not is_process_failure(exc):
                raise

    def pending(self) -> bool:
        """As :meth:`PauseOrders.pending`; a probe that meets a known failure acknowledges it and probes
        again (a probe from any source fails while a failure is unacknowledged)."""
        try:
            return super().pending()
        except Exception as exc:
            if not is_process_failure(exc):
                raise
        self.control.Ack_failed()
        try:
            return super().pending()
        except Exception as exc:
            if not is_process_failure(exc):
                raise
            return self.received > 0

    def meet(
        self,
        signalled: bool,
        training_left: bool,
        step: int,
        then: Callable[[Meeting], None] | None = None,
    ) -> Meeting:
        """Collective over the live members: the meeting and ``then`` (the save), agreed fault-tolerantly;
        after a loss, again over the survivors (ElasticEnd when a serving rank was lost)."""
        mine = self.mine(signalled, training_left)

        def attempt(redo: bool) -> Meeting:  # a redo: after a loss, over the survivors
            if redo:
                self._use_saver()
            meeting = self._gather(mine, step, redo)
            if then is not None:
                then(meeting)
            return meeting

        def commit(ok: bool) -> bool:
            if not ok:
                self.group.revoke()  # members still blocked in the meeting or the save are released
            return self.group.agree(ok)

        meeting = until_committed(
            attempt, commit, lambda _started: self._recover(step), self.group.is_failure
        )
        if self._gone and self.leader:
            log.warning(
                "elastic: lost rank(s) %s (start numbering) at the snapshot meeting of step %d; the "
                "snapshots go on over %d rank(s) (start ranks %s), each naming the lost rank(s) in its "
                "meta.pt: they lack its state and cannot be resumed",
                ", ".join(str(r) for r in self._gone),
                meeting.step,
                len(self.ranks),
                list(self.ranks),
            )
        self._gone = ()
        self.settled(meeting)
        return meeting

    def _gather(self, mine: np.ndarray, step: int, abandoned: bool) -> Meeting:
        """The meeting's sums and largest step over the members; then, unless the orders were sent over a
        group given up since (``abandoned``), this snapshot's orders received and own sends completed."""
        from mpi4py import MPI

        total = np.zeros_like(mine)
        self.control.Allreduce(mine, total, op=MPI.SUM)
        largest = int(self.control.allreduce(step, op=MPI.MAX))
        meeting = Meeting(int(total[0]), bool(total[1] and total[2]), int(total[2]), largest)
        if not abandoned:
            while self.received < meeting.orders - int(self.ordered):
                self._receive(self.control.Mprobe(tag=order_tag(self.number)))
            MPI.Request.Waitall(self._sends)
        return meeting

    def _recover(self, step: int) -> None:
        """Shrink to the live members (collective over them); the lost start ranks named in one line, or
        ElasticEnd when one of them served."""
        before = self.ranks
        # the old communicator is dropped, not freed: freeing is collective and would wait on the dead
        self.group = self.group.shrink()
        self.control = self.group.native
        self.ranks = self.group.start_ranks()
        gone = tuple(r for r in before if r not in self.ranks)
        self.lost = tuple(sorted({*self.lost, *gone}))
        self._sends, self.received = [], 0
        served = sorted(set(gone) & self.serving)
        if served and not self.parts.rule.model_survives(set(self.lost)):
            workers = [r for r in self.ranks if r not in self.serving]
            raise ElasticEnd(
                f"rank(s) {', '.join(str(r) for r in served)} (start numbering), serving the model (a "
                f"parameter server or the EASGD centre), was lost at the snapshot meeting (rank "
                f"{self.start_rank} at step {step}): the model lives there, so the job ends (elastic "
                f"training survives lost workers only); resume from {self._last_snapshot()}",
                place=workers.index(self.start_rank) if self.start_rank in workers else len(workers),
            )
        self._gone += gone

    def _last_snapshot(self) -> str:
        """The newest complete snapshot on disk (what ``--resume`` restarts from), for the end's line."""
        saver = self.parts.checkpoints.saver
        found = complete_checkpoints(saver.directory) if saver is not None else []
        return str(found[-1]) if found else "its last complete checkpoint (none written yet)"

    def close(self) -> None:
        """Drop the control communicator without freeing it: a member lost after the last meeting would
        hold up a collective free."""
        self.control = None
