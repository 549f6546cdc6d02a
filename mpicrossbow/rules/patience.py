"""How long an asynchronous rule waits on its peers: stall detection where no step is shared.

Synchronous rules meet every step, so the watchdog times steps. An asynchronous rank waits only on certain
peers — a worker on its parameter servers' or EASGD centre's reply, a server on its workers' pushes, a GOSGD
rank on its peers' goodbyes — so each of those waits is timed where it happens: after ``warn_after`` seconds
(``[watchdog] warn_after``) of silence the rank logs ``stall: ...`` naming the ranks it waits for, again every
``warn_after`` seconds, and after ``abort_after`` it raises :class:`Stalled`, whose one line ends the job like
any failure. ``abort_after = auto`` allows :data:`AUTO_ABORT_S`: a slow peer is not a dead one. A worker
waiting for its server's reply aborts only after twice that: the server, which knows which worker it is
waiting for, names the root cause first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..comm.base import Handle
from ..config.sections import WatchdogSection

log = logging.getLogger(__name__)

#: ``[watchdog] abort_after = auto`` for an asynchronous wait (seconds).
AUTO_ABORT_S = 600.0
#: :func:`wait_for` polls without sleeping for this long (a reply on its way: as a blocking wait would),
#: then backs off to sleeps of at most POLL_MAX_S, leaving the CPU to the ranks beside it.
SPIN_S, POLL_MAX_S = 0.01, 1e-3


class Stalled(RuntimeError):
    """A peer stayed silent for ``[watchdog] abort_after`` seconds: the job ends."""


@dataclass(frozen=True)
class Patience:
    """Seconds of silence before a wait is logged (0: never) and before the job is aborted (0: never)."""

    warn_after: float = 60.0
    abort_after: float = AUTO_ABORT_S

    @classmethod
    def of(cls, section: WatchdogSection) -> Patience:
        """``[watchdog] warn_after``/``abort_after`` for an asynchronous rule's waits on its peers (``auto``:
        :data:`AUTO_ABORT_S`)."""
        abort = AUTO_ABORT_S if section.abort_after == "auto" else float(section.abort_after)
        return cls(section.warn_after, abort)

    def doubled(self) -> Patience:
        """The patience of a rank that waits on a server: its abort comes after the server's, which knows
        whom it waits for (the root cause) and says so in the job's one line."""
        return Patience(self.warn_after, 2 * self.abort_after)


class Silence:
    """The silence of some peers, each timed from when it last spoke: :meth:`check` logs and aborts as
    :class:`Patience` says, :meth:`heard` restarts one peer's clock."""

    def __init__(self, patience: Patience, who: str, what: str, ranks: Iterable[int]) -> None:
        self.patience, self.who, self.what = patience, who, what
        now = time.monotonic()
        self.since = dict.fromkeys(ranks, now)
        self.next_warning = dict.fromkeys(self.since, patience.warn_after)

    def heard(self, rank: int) -> None:
        """``rank`` spoke: its silence starts again from now."""
        self.since[rank] = time.monotonic()
        self.next_warning[rank] = self.patience.warn_after

    def check(self, waiting_on: Iterable[int]) -> None:
        """Log the ranks of ``waiting_on`` silent for ``warn_after`` seconds (again every ``warn_after``);
        raise :class:`Stalled` once one is silent for ``abort_after``."""
        now = time.monotonic()
        abort, warn = self.patience.abort_after, self.patience.warn_after
        waited = {r: now - self.since[r] for r in waiting_on}
        gone = sorted(r for r, s in waited.items() if abort and s >= abort)
        late = sorted(r for r, s in waited.items() if warn and s >= self.next_warning[r])
        if not gone and not late:
            return
        ranks = gone or late
        line = (
            f"stall: {self.who} has waited {max(waited[r] for r in ranks):.0f} s {self.what} from rank(s) "
            + ", ".join(str(r) for r in ranks)
        )
        if gone:
            raise Stalled(f"{line}; aborting ([watchdog] abort_after = {abort:g} s)")
        log.warning("%s", line)
        for r in late:
            self.next_warning[r] += warn


def wait_for(
    handles: Mapping[int, Handle],
    patience: Patience,
    who: str,
    what: str,
    alive: Callable[[], None] | None = None,
) -> None:
    """Wait for every handle (keyed by the peer's rank), polling with back-off, logging the peers still
    silent after ``warn_after`` and raising :class:`Stalled` after ``abort_after``; ``alive()`` runs at
    every poll and may raise (a helper thread this wait depends on has failed)."""
    pending = dict(handles)
    silence = Silence(patience, who, what, pending)
    start, pause = time.monotonic(), 0.0
    while pending:
        for rank in [r for r, handle in pending.items() if handle.test()]:
            del pending[rank]
        if pending:
            if alive is not None:
                alive()
            silence.check(pending)
            if time.monotonic() - start > SPIN_S:
                pause = min(2 * pause or 2e-5, POLL_MAX_S)
            time.sleep(pause)
