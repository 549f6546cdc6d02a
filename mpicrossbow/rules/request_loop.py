"""The polling loop of a serving rank: answer workers' requests as they arrive, never blocking on one.

Shared by asynchronous EASGD's centre server and the parameter server. Each worker has at most one receive
posted (``recvs``); the loop tests them all, hands every arrived one to ``handle`` (which may re-post it) and
backs off between empty sweeps so an oversubscribed node's workers keep their CPU. The ``order`` test hook
names the worker whose next message to wait for (blocking), which makes the arrival order deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..comm.base import Handle
from .patience import Silence
from .peer_loss import Forgetting

if TYPE_CHECKING:
    import torch

#: The idle back-off between sweeps that found nothing (seconds): short enough to answer quickly, long
#: enough not to starve the workers of CPU on an oversubscribed node.
IDLE_MIN_S, IDLE_MAX_S = 2e-5, 1e-3

#: ``order(processed, waiting)``: the worker whose next message the server waits for, among those with a
#: receive posted.
Order = Callable[[int, Sequence[int]], int]

#: Values of a request's flag element: an update, or the worker's goodbye.
UPDATE, DONE = 0.0, 1.0

#: ``report(served, epoch)``: validate and log the served weights after ``epoch`` epoch-equivalents.
Report = Callable[["torch.Tensor", float], None]


def serve_requests(
    recvs: Mapping[int, Handle],
    handle: Callable[[int], None],
    order: Order | None,
    sends: dict[int, Handle] | None = None,
    tick: Callable[[], None] | None = None,
    silence: Silence | None = None,
    waiting_on: Callable[[], Iterable[int]] = lambda: (),
    lost: Callable[[int], None] | None = None,
) -> None:
    """Call ``handle(worker)`` for each arrived request until no receive is posted in ``recvs``; then wait
    for every reply still in ``sends`` (and empty it), so nothing the server sent is left in flight.
    ``tick()`` runs between sweeps (cheap: the run's signal watch); ``silence`` times the workers
    ``waiting_on()`` names (those the server expects a request from), each from its last request.

    ``lost(worker)`` (elastic training): a receive or reply that meets its worker's loss calls it, which
    drops that worker's receive and reply; the others are served on (:class:`~.peer_loss.Forgetting`).
    Without it the loss is raised."""
    processed, idle = 0, IDLE_MIN_S
    while recvs:
        if tick is not None:
            tick()
        if silence is not None:
            silence.check(waiting_on())
        if order is not None:
            worker = order(processed, sorted(recvs))
            recvs[worker].wait()
            arrived = [worker]
        else:
            arrived = [w for w in list(recvs) if _arrived(recvs, w, lost)]
        for worker in arrived:
            if silence is not None:
                silence.heard(worker)
            handle(worker)
            processed += 1
        if arrived:
            idle = IDLE_MIN_S
        else:
            time.sleep(idle)
            idle = min(2 * idle, IDLE_MAX_S)
    for worker, reply in list((sends or {}).items()):
        with Forgetting(worker, lost):
            reply.wait()
    if sends is not None:
        sends.clear()


def _arrived(recvs: Mapping[int, Handle], worker: int, lost: Callable[[int], None] | None) -> bool:
    """Whether ``worker``'s request arrived; False (and ``lost(worker)``) when it never will."""
    with Forgetting(worker, lost):
        return recvs[worker].test()
    return False
