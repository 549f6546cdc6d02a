"""Asynchronous EASGD's wire protocol: the centre's server loop (rank 0) and a worker's exchange with it.

Theano-MPI style: the centre x~ lives on a server rank that does not train. Who sends what to whom, and when:

* A worker rank, every τ local steps: posts a receive for the reply, sends a snapshot of the flat weights
  of **all its m learners in one message** (non-blocking isend of a copy, so training memory is never on
  the wire; one round trip per rank, not per learner), waits for the reply ``[e_1 .. e_m]`` and applies
  ``x_j ← x_j − e_j``. It waits for its own reply right away, so each ``e_j`` lands on the very weights
  it sent.
* The server keeps **one posted receive per worker** and tests them all in a loop, never blocking on one
  worker, so a slow worker never stalls the others. For each request, as it arrives, it computes
  ``e = α (x_i − x~)`` with the x_i that was sent, applies ``x~ ← x~ + e``, sends ``e`` back and re-posts
  that worker's receive. docs/rules.md has the worker read x~ and compute e itself; computing e at the server
  is the same update made atomic (no other worker's update can slip between the read of x~ and the write).
* Termination: after its last step a worker sends a *done* message through the same channel (same tag,
  same size, flag element set), so it consumes the receive the server has posted for it and no receive is
  left dangling nor needs cancelling. The server leaves :meth:`EASGDServer.serve` once every worker is
  done and every reply send has completed: nothing is in flight on either side.

A request is ``[x_1 .. x_m (m·n values), stats, flag, progress]``: stats the mean of the worker's learners'
BatchNorm buffers (the centre is validated with them: :mod:`~mpicrossbow.rules.served_stats`), flag 0 asks
for an update, 1 says done; progress is the worker's epochs completed (steps / steps per epoch). The
server reports the centre once per epoch-equivalent: whenever the mean progress over workers crosses an
integer (with equal shards that is every ``(n_batch_train / τ) · (N − 1) · m`` updates, n_batch_train
being a worker's steps per epoch).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from ..comm.base import Communicator, Handle
from ..trace import instant, span
from .patience import Patience, Silence, wait_for
from .peer_loss import Forgetting, server_lost
from .request_loop import DONE, UPDATE, Order, Report, serve_requests
from .served_stats import ServedStats

log = logging.getLogger(__name__)

#: Message tags (below MPI's guaranteed tag upper bound 32767).
REQUEST_TAG = 7101
REPLY_TAG = 7102


class EASGDWorker:
    """A training rank's side: every τ steps, send all x_j at once, apply the replies ``x_j ← x_j − e_j``."""

    def __init__(
        self,
        comm: Communicator,
        params: Sequence[torch.Tensor],
        server: int = 0,
        stats: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        self.comm, self.params, self.server = comm, list(params), server
        #: The worker's current BatchNorm statistics (flat), sent along with every request.
        self.stats = stats
        n = len(self.params) * self.params[0].numel()
        self._head = n + (stats().numel() if stats is not None else 0)
        self.request = self.params[0].new_zeros(self._head + 2)
        self.reply = self.params[0].new_zeros(n)
        #: Elastic updates answered so far (one per learner per exchange).
        self.requests = 0
        self.done = False
        #: How long the centre may stay silent (``[watchdog]``).
        self.patience = Patience()

    def exchange(self, progress: float) -> None:
        """One round trip: snapshots of all learners' weights out, one elastic difference per learner back.
        A lost centre ends the job (ElasticEnd): the centre lives there."""
        with self._centre_lost():
            self._round_trip(progress)

    def _centre_lost(self) -> AbstractContextManager[None]:
        """The job's end when the centre is lost, met in an exchange or in the done message (a snapshot's
        drain): one line, the lowest worker's when it is free to say it."""
        return server_lost(
            f"worker rank {self.comm.rank}",
            f"the EASGD centre (rank {self.server})",
            "the job ends (elastic training survives lost workers only)",
            place=[r for r in range(self.comm.size) if r != self.server].index(self.comm.rank),
        )

    def _round_trip(self, progress: float) -> None:
        assert not self.done, "exchange after done"
        n = self.reply.numel()
        for x, slot in zip(self.params, self.request[:n].view(len(self.params), -1), strict=True):
            slot.copy_(x)
        self._tail(UPDATE, progress)
        with span("elastic request and reply", "message", track="messages"):
            recv = self.comm.irecv(self.reply, self.server, REPLY_TAG)
            send = self.comm.isend(self.request, self.server, REQUEST_TAG)
            # our own reply, right away: each e_j lands on the weights we sent
            wait_for(
                {self.server: recv}, self.patience, f"worker rank {self.comm.rank}", "for the centre's reply"
            )
            send.wait()
        for x, e in zip(self.params, self.reply.view(len(self.params), -1), strict=True):
            x.sub_(e)
        self.requests += len(self.params)

    def _tail(self, flag: float, progress: float) -> None:
        """Write the statistics, the flag and the progress after the weights."""
        n, head = self.reply.numel(), self._head
        if self.stats is not None and head > n:
            self.request[n:head].copy_(self.stats())
        self.request[head] = flag
        self.request[head + 1] = progress

    def finish(self, progress: float) -> None:
        """Send the done message (consuming the server's posted receive) and wait until it has left."""
        if self.done:
            return
        self.request[: self.reply.numel()].zero_()
        self._tail(DONE, progress)
        with self._centre_lost():
            self.comm.isend(self.request, self.server, REQUEST_TAG).wait()
        self.done = True


class EASGDServer:
    """Rank 0's side: holds the centre x~ and answers each worker's request as it arrives."""

    def __init__(
        self,
        comm: Communicator,
        centre: torch.Tensor,
        alpha: float,
        order: Order | None = None,
        learners: int = 1,
        stats_size: int = 0,
        beta: float | None = None,
    ) -> None:
        self.comm, self.centre, self.alpha, self.order = comm, centre, alpha, order
        self.learners = learners
        #: β = kα when α was left to its default (β / k, k the live workers' learners): α then follows
        #: the live workers when one is lost, so the centre's pull per unit of time stays what it was (a
        #: worker applies the e = α(x − x~) the server sends it: α lives here only). None: α is explicit.
        self.beta = beta
        self.workers = [r for r in range(comm.size) if r != comm.rank]
        #: The workers' latest BatchNorm buffers (``stats_size`` values each), carried by their requests.
        self.stats = ServedStats(stats_size)
        n = learners * centre.numel()
        self._inbox = {w: centre.new_zeros(n + stats_size + 2) for w in self.workers}
        self._outbox = {w: centre.new_zeros(n) for w in self.workers}
        self._recvs: dict[int, Handle] = {}
        self._sends: dict[int, Handle] = {}
        #: Elastic updates applied to the centre so far.
        self.updates = 0
        #: Workers lost for good (elastic training): forgotten, never waited for again.
        self.lost: set[int] = set()
        #: Each worker's latest reported progress in epochs.
        self.progress = {w: 0.0 for w in self.workers}
        self._reported = 0

    @property
    def in_flight(self) -> int:
        """Receives posted and reply sends started that have not completed (0 after :meth:`serve`)."""
        return len(self._recvs) + len(self._sends)

    @property
    def epoch(self) -> float:
        """Epoch-equivalents done: the mean of the (live) workers' progress."""
        return sum(self.progress.values()) / max(len(self.progress), 1)

    def serve(
        self, report: Report, tick: Callable[[], None] | None = None, patience: Patience | None = None
    ) -> None:
        """Answer requests until every worker is done and every reply has been delivered (``tick``
        between sweeps); a worker not done that stays silent is a stall (``patience``)."""
        for w in self.workers:
            if w not in self.lost:
                self._post(w)
        silence = Silence(
            patience or Patience(), f"EASGD centre rank {self.comm.rank}", "for a request", self.workers
        )
        serve_requests(
            self._recvs, lambda w: self._handle(w, report), self.order, self._sends, tick, silence,
            lambda: [w for w in self.workers if w in self._recvs], self.forget,
        )  # fmt: skip
        log.info(
            "EASGD server: %d elastic updates from %d worker(s), all done", self.updates, len(self.workers)
        )

    def forget(self, w: int) -> None:
        """Worker ``w`` was lost (elastic training: a receive from it or a reply to it met its death): its
        receive and reply are dropped, never waited for, its progress no longer counts; the others are
        served on."""
        if w in self.lost:
            return
        self.lost.add(w)
        self._recvs.pop(w, None)
        self._sends.pop(w, None)
        progress = self.progress.pop(w, 0.0)
        live = len(self.workers) - len(self.lost)
        follows = ""
        if self.beta is not None and live:
            self.alpha = self.beta / (live * self.learners)
            follows = f" with α = {self.alpha:g} (β / k for their {live * self.learners} learner(s))"
        log.warning(
            "EASGD centre rank %d: worker rank %d was lost after %.2f epoch(s); serving the %d other(s)%s",
            self.comm.rank, w, progress, live, follows,
        )  # fmt: skip

    def _post(self, w: int) -> None:
        self._recvs[w] = self.comm.irecv(self._inbox[w], w, REQUEST_TAG)

    def _handle(self, w: int, report: Report) -> None:
        """One arrived message from worker ``w``: an elastic update and its reply, or its done flag."""
        del self._recvs[w]
        msg = self._inbox[w]
        n = self.learners * self.centre.numel()
        head = n + self.stats.size
        self.progress[w] = float(msg[head + 1])
        self.stats.record(w, msg[n:head])
        if float(msg[head]) == DONE:
            log.debug("EASGD server: worker %d done after %.2f epoch(s)", w, self.progress[w])
        else:
            with Forgetting(w, self.forget) as met:
                if w in self._sends:  # the previous reply to w was received before w could ask again
                    self._sends.pop(w).wait()
            if met.lost:
                return
            sent = msg[:n].view(self.learners, -1)
            for x, e in zip(sent, self._outbox[w].view(self.learners, -1), strict=True):
                torch.sub(x, self.centre, out=e)  # learner by learner: each sees the centre the last moved
                e.mul_(self.alpha)
                self.centre.add_(e)
            self.updates += self.learners
            with Forgetting(w, self.forget) as met:
                self._sends[w] = self.comm.isend(self._outbox[w], w, REPLY_TAG)
                self._post(w)
            if met.lost:
                return
            instant("elastic update and reply", "message", worker=w)
        epoch = self.epoch
        if math.floor(epoch) > self._reported:
            self._reported = math.floor(epoch)
            report(self.centre, epoch)
