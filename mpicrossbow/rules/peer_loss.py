"""An asynchronous rule's side of a lost peer (elastic training): the one place of the rules, besides their
``on_rebind`` and GSP's committed group steps, that knows the communicator can fail.

Asynchronous ranks never meet in a collective between steps, so nothing agrees on a loss for them: each rank
meets it where it talks to the lost peer, in a point-to-point operation that raises
:class:`~mpicrossbow.comm.ulfm.PeerLost`. What happens next is one of two things, both written here:

* a peer that can be done without (a parameter server's or EASGD centre's worker, a gossip peer) is
  forgotten by whoever met it (:class:`Forgetting`, around the operations toward it; the rule's own
  ``forget`` says what forgetting means for it), and the others go on;
* a worker whose server is lost ends the job in one line (:func:`server_lost`: the model lives there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from ..comm.ulfm import ElasticEnd, PeerLost


class Forgetting:
    """``with Forgetting(peer, lost) as met:`` around operations toward one peer (a server's reply to a
    worker and its receive posted again, a gossip message sent or received): when one meets the peer's loss
    the rest of the block is skipped, ``lost(peer)`` forgets it and :attr:`lost` is True, so the caller
    moves on. With ``lost`` None the loss is raised (a run that is not elastic cannot meet one)."""

    def __init__(self, peer: int, lost: Callable[[int], None] | None) -> None:
        self.peer, self.forget = peer, lost
        #: Whether the block met the peer's loss.
        self.lost = False

    def __enter__(self) -> Forgetting:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if kind is not None and issubclass(kind, PeerLost) and self.forget is not None:
            self.lost = True
            self.forget(self.peer)
            return True
        return False


@contextmanager
def server_lost(worker: str, what: str, why: str, place: int) -> Iterator[None]:
    """A worker's request and reply inside the block: a loss it meets is its server's (a worker talks to
    nobody else), and ends the job in one line — ``"{worker}: {what} was lost (...); {why}"`` — said by the
    worker at ``place`` in line (:class:`~mpicrossbow.comm.ulfm.ElasticEnd`)."""
    try:
        yield
    except PeerLost as exc:
        raise ElasticEnd(f"{worker}: {what} was lost ({exc}); {why}", place=place) from exc
