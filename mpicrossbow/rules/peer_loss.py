"""An asynchronous rule's side of a lost peer (elastic training): the one place of the rules, besides their
``on_rebind`` and GSP's committed group steps, that knows the communicator can fail.

Asynchronous ranks never meet in a collective between steps, so nothing agrees on a loss for them: each rank
meets it where it talks to the lost peer, in a point-to-point operation that raises
:class:`~mpicrossbow.comm.ulfm.PeerLost`. What happens next is one of two things, both written here:

* a peer that can be done without (a parameter server's or EASGD centre's worker, a gossip peer) is
  forgotten by whoever met it (:class:`Forgetting`, around the operations toward it; the rule's own
  ``forget`` says what forgetting means for it), and the others go on;
* a request to a peer that has a stand-in (a parameter server's backup, :mod:`.server_backup`) is made
  again to the stand-in (:class:`Rerouted`);
* a worker whose server is lost, with no stand-in, ends the job in one line (:func:`server_lost`: the model
  lives there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from ..comm.base import Handle
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


class Rerouted(Handle):
    """A request to a peer that has a stand-in: when it meets the peer's loss, ``again()`` makes the same
    request to the stand-in and that one is awaited instead; ``again()`` returning None means there is no
    stand-in, and the loss is raised."""

    def __init__(self, handle: Handle, again: Callable[[], Handle | None]) -> None:
        self.handle, self.again = handle, again

    def _stand_in(self, loss: PeerLost) -> None:
        replacement = self.again()
        if replacement is None:
            raise loss
        self.handle = replacement

    def test(self) -> bool:
        """Whether the request (to the peer or, once it was lost, its stand-in) completed."""
        try:
            return self.handle.test()
        except PeerLost as loss:
            self._stand_in(loss)
            return False

    def wait(self) -> None:
        """Until the request completed, at the stand-in if the peer was lost."""
        while True:
            try:
                self.handle.wait()
                return
            except PeerLost as loss:
                self._stand_in(loss)
