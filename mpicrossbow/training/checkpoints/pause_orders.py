"""The control plane of an asynchronous run's snapshots: orders to pause, and the meeting of every rank.

Asynchronous ranks never meet before the end, so a checkpoint needs them to agree on a moment first. Who
sends what to whom, and when:

* **Order.** A rank that wants a snapshot — its own step reached the checkpoint interval, or it caught
  SIGTERM/SIGUSR1 — sends every other rank one small order ``[k, stop]`` (k: the snapshot's number, stop: 1
  after a signal) on a private duplicate of COMM_WORLD, so no rule's message can match it, and pauses.
  Several ranks may order snapshot k at once; that is one snapshot.
* **Noticing.** A training rank probes for an order after every step (``MPI_Improbe``: microseconds) and
  pauses when one is in; a serving rank needs no probe: it pauses when every worker's drain reached it.
* **Meeting.** A pausing rank drains its rule (:meth:`~mpicrossbow.rules.base.Rule.finish`: every message
  in flight is delivered, nothing dropped) and joins one collective with every other rank — those pausing,
  the servers, and the ranks whose training ended, which meet here at the end anyway. It sums who ordered,
  who was signalled and who still has training left, and takes the largest step. Each rank then receives the
  orders it has not received yet (it knows how many were sent), so no order is left over for a later
  snapshot. Orders alternate between two tags by the snapshot's parity: a rank back at work may order the
  next snapshot while a slower one is still receiving this one's, and neither can take the other's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...launch.world import World

log = logging.getLogger(__name__)

ORDER_TAG = 7301


def order_tag(number: int) -> int:
    """The tag of snapshot ``number``'s orders: two tags, alternating."""
    return ORDER_TAG + number % 2


@dataclass(frozen=True)
class Meeting:
    """What every rank learnt at a meeting: the same values everywhere."""

    #: Ranks that sent an order for this snapshot (0: nobody asked; the meeting is the run's end).
    orders: int
    #: Whether any rank was signalled (SIGTERM/SIGUSR1) while training was left: save, then every rank
    #: stops (a signal at the run's very end changes nothing: the run is complete).
    stop: bool
    #: Ranks that still have training left (0: the run is over).
    training: int
    #: The largest step any rank has taken: the checkpoint's name.
    step: int

    @property
    def snapshot(self) -> bool:
        """Whether this meeting takes a snapshot (somebody ordered one)."""
        return self.orders > 0 or self.stop


class PauseOrders:
    """One rank's end of the control plane (inert in a single process: every meeting is its own)."""

    def __init__(self, world: World, control: Any = None) -> None:
        self.world = world
        #: The private communicator of orders and meetings: ``control`` when given (elastic training's
        #: fault-tolerant one), else a duplicate of the world's (None in a single process).
        self.control: Any = control
        if control is None and world.mpi is not None and world.size > 1:
            self.control = world.mpi.Dup()
        #: The snapshot being agreed (counts up from 0 at every meeting that took one).
        self.number = 0
        #: Orders for the current number received so far, and whether this rank sent its own.
        self.received = 0
        self.ordered = False
        self.stop_asked = False
        self._sends: list[Any] = []
        self._buffer = np.zeros(2, dtype=np.int64)

    def order(self, stop: bool) -> None:
        """Ask every other rank to pause for snapshot ``number`` (once per snapshot)."""
        if self.ordered:
            return
        self.ordered, self.stop_asked = True, self.stop_asked or stop
        if self.control is None:
            return
        message = np.array([self.number, int(stop)], dtype=np.int64)
        for peer in range(self.control.Get_size()):
            if peer != self.control.Get_rank():
                self._send(message, peer)
        self._keep = message  # alive until the sends complete

    def _send(self, message: np.ndarray, peer: int) -> None:
        """Start sending ``message`` (an order) to ``peer``; completed at the meeting."""
        self._sends.append(self.control.Isend(message, dest=peer, tag=order_tag(self.number)))

    def pending(self) -> bool:
        """Whether an order for the current snapshot came in (receives every one that did)."""
        if self.control is None:
            return False
        while (message := self.control.Improbe(tag=order_tag(self.number))) is not None:
            self._receive(message)
        return self.received > 0

    def _receive(self, message: Any) -> None:
        """Take the order a matched probe found (a matched probe: MPICH across nodes has left a plain
        ``Iprobe`` then ``Recv`` from any source waiting forever, the message seen but never received)."""
        message.Recv(self._buffer)
        number, stop = (int(v) for v in self._buffer)
        if number != self.number:
            raise RuntimeError(f"snapshot order {number} arrived during snapshot {self.number}")
        self.received += 1
        self.stop_asked = self.stop_asked or bool(stop)

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for the meeting (logs its snapshots): rank 0 of the world."""
        return self.world.rank == 0

    def mine(self, signalled: bool, training_left: bool) -> np.ndarray:
        """This rank's contribution to the meeting: ordered, stop wanted, training left."""
        return np.array(
            [int(self.ordered), int(signalled or self.stop_asked), int(training_left)], dtype=np.int64
        )

    def meet(
        self,
        signalled: bool,
        training_left: bool,
        step: int,
        then: Callable[[Meeting], None] | None = None,
    ) -> Meeting:
        """Collective: every rank's view summed; then every order of this snapshot received and every own
        send completed, so the next snapshot starts with none in flight; ``then`` (the save) last."""
        mine = self.mine(signalled, training_left)
        if self.control is None:
            meeting = Meeting(int(mine[0]), bool(mine[1] and mine[2]), int(mine[2]), step)
        else:
            from mpi4py import MPI

            total = np.zeros_like(mine)
            self.control.Allreduce(mine, total, op=MPI.SUM)
            largest = int(self.control.allreduce(step, op=MPI.MAX))
            meeting = Meeting(int(total[0]), bool(total[1] and total[2]), int(total[2]), largest)
            while self.received < meeting.orders - int(self.ordered):
                self._receive(self.control.Mprobe(tag=order_tag(self.number)))
            MPI.Request.Waitall(self._sends)
        self.settled(meeting)
        if then is not None:
            then(meeting)
        return meeting

    def settled(self, meeting: Meeting) -> None:
        """After a meeting: the next snapshot's number, with no order received or sent yet."""
        self._sends.clear()
        if meeting.snapshot:
            self.number += 1
        self.received, self.ordered, self.stop_asked = 0, False, False

    def close(self) -> None:
        """Free the duplicate communicator (after the last meeting: nothing is in flight)."""
        if self.control is not None:
            self.control.Free()
            self.control = None
