"""``until_committed``: run collective work, commit it, redo it over the survivors after a loss — once.

Elastic training does one thing in three places: the run's committed collectives (the window's agreement,
validation, the epoch's statistics: :class:`~mpicrossbow.training.elastic.fault_tolerance.FaultTolerance`),
GSP's group steps (:mod:`mpicrossbow.rules.gsp`) and an asynchronous run's snapshot meeting
(:mod:`mpicrossbow.training.elastic.elastic_pause`). Each is the same protocol, written here once:

1. every member runs the work; a member whose work met a lost rank (an exception ``is_failure`` accepts)
   says no;
2. the members **commit**: a member that says no revokes the group first (so no member stays blocked in the
   work), then all agree fault-tolerantly (``MPI_Comm_agree``) on the AND of their answers — the same answer
   on every survivor;
3. yes: the work counts and its value is returned; no: every survivor calls ``recover`` (shrink to the live
   members and whatever the caller moves on with them), and the work runs again over the survivors, told
   that it is a redo.

So a piece of collective work is applied on every survivor or on none, never on some.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .ulfm import PeerLost

T = TypeVar("T")


def lost_peer(exc: BaseException) -> bool:
    """The default ``is_failure``: a :class:`~.ulfm.PeerLost` from the elastic communicator."""
    return isinstance(exc, PeerLost)


def until_committed(
    work: Callable[[bool], T],
    commit: Callable[[bool], bool],
    recover: Callable[[float], None],
    is_failure: Callable[[BaseException], bool] = lost_peer,
    clock: Callable[[], float] | None = None,
) -> T:
    """``work(redo)`` until every member committed it (see the module doc); its value on that attempt.

    ``commit(ok)`` revokes where not ``ok`` and agrees (:meth:`~.elastic.ElasticCommunicator.commit`);
    ``recover(started)`` moves the survivors on after a failed commit, ``started`` being when the failed
    attempt began (``clock()``, for the recovery's timing); exceptions ``is_failure`` does not accept
    propagate untouched.
    """
    redo = False
    while True:
        started = clock() if clock is not None else 0.0
        ok, value = True, None
        try:
            value = work(redo)
        except Exception as exc:
            if not is_failure(exc):
                raise
            ok = False
        if commit(ok):
            return value  # type: ignore[return-value]
        recover(started)
        redo = True
