"""A parameter server's backup: its state mirrored message by message, and the takeover when it is lost.

Who sends what to whom (``[elastic] server_backups = 1``, placement = rank, S servers over N ranks): server j
(rank j) has a backup, rank N − S + j — the last ranks, so on another node under slot and node mapping
alike — which trains not. After the server handled a worker's message (a push applied, discarded or held; a
goodbye) or forgot a lost worker, it forwards that event to the backup (:meth:`Mirror.forward`, the worker's
message with two values after it: the worker's rank and the kind of event), which handles it the same way in
the same order, sends no reply, and acknowledges it: once it has handled every event that has arrived,
one message counting them (the backup is lazy: a poll that backs off, one acknowledgement for several
events, so its rank takes little of a CPU it may share with workers). The server does not wait for a
push's acknowledgement (at most :data:`LAG` events go unacknowledged): its reply goes out at once and tells
the worker how many of its pushes the backup has acknowledged, and the worker keeps the others (their
messages) until a later reply confirms them. A goodbye, and a forgotten worker, wait until the backup has
every event.

The takeover. The server lost, the backup's receive from it fails (ULFM): the backup says so in one line
(:func:`mirror_until_done` returns False), tells every live worker what it holds of it (a :data:`NOTICE_TAG`
message: the worker's pushes it counted and whether it saw its goodbye) and serves on from its state
(:meth:`~.parameter_server.ParameterServer.take_over`). A worker meets the loss in its exchange with the
server, routes that shard to the backup from then on (:class:`Routes`), reads the notice and sends the
backup, oldest first, the pushes it kept that the backup did not count, then the push it had no reply to —
a push carries its number, and one the backup's clock already counts was applied before the loss, so it is
answered and not applied again (counted as a resend) — and a goodbye it had no acknowledgement of unless the
notice says the backup saw it. Nothing is lost and nothing applied twice; each worker's goodbye carries its
push count, and the server checks it against its clock. (The pushes sent again are applied after others the
server had applied before them: the backup's w then differs from the lost server's by that order.)

A lost backup costs its server the mirror (one warning); a lost server whose backup is lost too ends the job.
The mirror's cost: each push travels once more, server to backup, and the backup applies it as the server
did (``python -m benchmarks.server_backup``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from ..comm.base import Communicator, Handle
from .patience import Patience, Silence, wait_for
from .peer_loss import Forgetting

log = logging.getLogger(__name__)

MIRROR_TAG, MIRROR_ACK_TAG, NOTICE_TAG, DONE_ACK_TAG = 7203, 7204, 7205, 7206
#: The kinds of a mirrored event (the last value of a forwarded message).
HANDLED, FORGOTTEN = 0.0, 1.0
#: A server's events sent to its backup and not yet acknowledged, at most: the pushes a worker may have to
#: send again after a takeover, and the buffers a server keeps for them.
LAG = 8
#: A backup polls for its server's next event at a pace of a quarter of :data:`LAG` events (their mean
#: interval so far), backing off to the longest while none comes, within these bounds (seconds): the
#: server waits for no acknowledgement until LAG events are out, and each poll that wakes the backup may
#: take a core from a worker beside it.
POLL_MIN_S = 1e-4
POLL_MAX_S = 4e-3
#: A server looks for its backup's acknowledgements (in a reply's :meth:`Mirror.confirmed`) only once this
#: many events are unacknowledged; the lag's bound, :data:`LAG`, waits for them in any case.
ACK_LOOK_AT = LAG // 2


def backup_ranks(servers: int, size: int) -> list[int]:
    """The backup of each server rank 0..S-1: the last S ranks, in order."""
    return list(range(size - servers, size))


class Mirror:
    """A server's side: forward each event to the backup, at most :data:`LAG` of them unacknowledged.

    A push's event is sent and the reply goes out at once; the reply tells the worker how many of its pushes
    the backup has acknowledged (:meth:`confirmed`), so the worker keeps the others to send again after a
    takeover. A DONE or a forgotten worker waits until the backup has everything (the worker counts on its
    DONE being there)."""

    def __init__(self, comm: Communicator, backup: int, message_size: int, like: torch.Tensor) -> None:
        self.comm, self.backup = comm, backup
        self._slots = [like.new_zeros(message_size + 2) for _ in range(LAG)]
        self._sends: list[Handle | None] = [None] * LAG
        self._ack = like.new_zeros(1)
        self._ack_recv: Handle | None = None
        #: (worker, push number or 0) of each event sent and not yet acknowledged, oldest first.
        self._unacked: deque[tuple[int, int]] = deque()
        self._confirmed: dict[int, int] = {}
        #: The backup was lost: the server goes on without a mirror.
        self.lost = False
        #: Events acknowledged by the backup.
        self.forwarded = 0
        self.patience = Patience()

    def confirmed(self, worker: int) -> int:
        """How many of ``worker``'s pushes the backup has acknowledged so far, as last taken: the
        acknowledgements are looked for only once :data:`ACK_LOOK_AT` events are out. An earlier figure is
        safe (the worker keeps a push longer) and saves a test of a receive that has mostly not arrived,
        which on cores shared with the workers costs the server a yield of its core each time (Open MPI
        yields when idle on an oversubscribed node): in this server's reply path, every reply."""
        if len(self._unacked) >= ACK_LOOK_AT:
            self.poll()
        return self._confirmed.get(worker, 0)

    def forward(
        self, worker: int, message: torch.Tensor | None, kind: float, number: int, settle: bool = False
    ) -> None:
        """Send the backup ``message`` (worker ``worker``'s push ``number``, or its DONE, handled; None: the
        worker was forgotten); ``settle``: wait until the backup acknowledged every event so far."""
        if self.lost:
            return
        with Forgetting(self.backup, self._lost):
            while len(self._unacked) >= LAG:  # the lag's bound: wait for the oldest acknowledgement
                self._acknowledged(block=True)
            slot = (self.forwarded + len(self._unacked)) % LAG
            previous = self._sends[slot]
            if previous is not None:
                previous.wait()
            event = self._slots[slot]
            if message is not None:
                event[:-2].copy_(message)
            event[-2], event[-1] = float(worker), kind
            self._sends[slot] = self.comm.isend(event, self.backup, MIRROR_TAG)
            self._unacked.append((worker, number))
            while settle and self._unacked:
                self._acknowledged(block=True)

    def poll(self) -> None:
        """Take the acknowledgements that arrived (no wait)."""
        if self.lost:
            return
        with Forgetting(self.backup, self._lost):
            while self._unacked and self._acknowledged(block=False):
                pass

    def _acknowledged(self, block: bool) -> bool:
        """The oldest event's acknowledgement, waited for (``block``) or tested; True when it arrived."""
        if self._ack_recv is None:
            self._ack_recv = self.comm.irecv(self._ack, self.backup, MIRROR_ACK_TAG)
        if block:
            who = f"parameter server rank {self.comm.rank}"
            wait_for({self.backup: self._ack_recv}, self.patience, who, "for its backup's acknowledgement")
        elif not self._ack_recv.test():
            return False
        self._ack_recv = None
        for _ in range(int(self._ack[0])):  # the events the backup has handled since its last message
            worker, number = self._unacked.popleft()
            if number:
                self._confirmed[worker] = number
            self.forwarded += 1
        return True

    def _lost(self, backup: int) -> None:
        self.lost = True
        log.warning(
            "parameter server rank %d: its backup, rank %d, was lost after %d mirrored event(s); serving on "
            "without a backup",
            self.comm.rank, backup, self.forwarded,
        )  # fmt: skip


class ShadowState(Protocol):
    """What a backup's loop needs of the server state it keeps (a
    :class:`~.parameter_server.ParameterServer` shadowing its server)."""

    comm: Communicator
    w: torch.Tensor

    @property
    def message_size(self) -> int:
        """The values of one worker's message."""
        ...

    def all_done(self) -> bool:
        """Whether every worker said DONE or was lost."""
        ...

    def replay(self, r: int, msg: torch.Tensor) -> None:
        """Apply the server's handling of worker ``r``'s message ``msg``."""
        ...

    def forget(self, r: int) -> None:
        """Forget worker ``r``, as the server did."""
        ...


def mirror_until_done(
    server: ShadowState,
    comm: Communicator,
    primary: int,
    patience: Patience,
    tick: Callable[[], None] | None,
) -> bool:
    """A backup's loop: apply every event its server forwards over ``comm`` (the server's mirror's channel),
    in order, and acknowledge them (one message for those that had arrived), until every worker is done
    (True: the server finished) or the server is lost (False: the caller takes over)."""
    event = server.w.new_zeros(server.message_size + 2)
    ack = server.w.new_zeros(1)
    silence = Silence(patience, f"backup rank {comm.rank}", "for its server's next event", [primary])
    gone: Callable[[int], None] = lambda rank: None  # noqa: E731
    recv: Handle | None = None
    handled = 0  # events handled and not yet acknowledged
    pace, last = POLL_MIN_S, time.monotonic()  # seconds between polls; when the last event arrived
    while not server.all_done():
        if recv is None:
            recv = comm.irecv(event, primary, MIRROR_TAG)
        with Forgetting(primary, gone) as met:
            arrived = recv.test()
            if not arrived and handled:  # nothing more has arrived: acknowledge what was handled
                ack[0] = handled
                comm.isend(ack, primary, MIRROR_ACK_TAG).wait()
                handled = 0
            wait = pace
            while not arrived:  # at the pace, then backing off while nothing comes (the start, the end)
                if tick is not None:
                    tick()
                silence.check([primary])
                time.sleep(wait)
                wait = min(2 * wait, POLL_MAX_S)
                arrived = recv.test()
        if met.lost:
            return False
        recv, now = None, time.monotonic()
        pace = min(max(0.8 * pace + 0.2 * (now - last) * LAG / 4, POLL_MIN_S), POLL_MAX_S)
        last = now
        silence.heard(primary)
        worker, kind = int(event[-2]), float(event[-1])
        if kind == FORGOTTEN:
            server.forget(worker)
        else:
            server.replay(worker, event[:-2])
        handled += 1
    if handled:
        ack[0] = handled
        with Forgetting(primary, gone) as met:
            comm.isend(ack, primary, MIRROR_ACK_TAG).wait()
        if met.lost:
            return False
    return True


class Routes:
    """A worker's side: which rank serves each shard now, and the move to its backup when a server is
    lost."""

    def __init__(self, comm: Communicator, servers: int, backups: list[int], worker: str, place: int) -> None:
        self.comm, self.worker, self.place = comm, worker, place
        #: The rank serving shard j now.
        self.now = list(range(servers))
        self.backups = backups
        self._notice = torch.zeros(2, dtype=torch.float64)
        #: Whether the last notice said the backup saw this worker's DONE.
        self.seen_done = False

    def lost(self, shard: int) -> int | None:
        """Shard ``shard``'s server was lost: its backup serves it from now on (one line, and its rank
        returned), or None when the backup was serving it already (the loss ends the job)."""
        lost, backup = self.now[shard], self.backups[shard]
        if lost == backup:
            return None
        self.now[shard] = backup
        log.warning(
            "%s: parameter server rank %d was lost; shard %d is served by its backup, rank %d, from now on",
            self.worker,
            lost,
            shard,
            backup,
        )
        return backup

    def notice(self, shard: int, patience: Patience) -> tuple[int, bool]:
        """The backup's notice of what it holds of this worker: (pushes counted, goodbye seen); also kept in
        :attr:`seen_done`."""
        backup = self.now[shard]
        recv: Handle = self.comm.irecv(self._notice, backup, NOTICE_TAG)
        wait_for({backup: recv}, patience, self.worker, f"for backup rank {backup}'s takeover notice")
        self.seen_done = bool(self._notice[1])
        return int(self._notice[0]), self.seen_done
