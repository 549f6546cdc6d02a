"""Backoff: how a wait on node-shared memory gives its core back the longer it lasts.

A rank waiting for its node peers' flags (:mod:`.shm`) polls memory: no MPI call can block for it. Polling
flat out is right for the microseconds an ordinary step waits, and wrong for the milliseconds it waits for a
straggler, a rank slowed on purpose, a checkpoint write or a replacement starting: every waiting rank then
burns a core that the rank everybody waits for (or its data loader) could use. Measured with 4 ranks on 2
cores, ranks 1-3 waiting for a slowed rank 0: half the machine's cycles went to ``sched_yield`` in this
poll. The three phases:

1. **spin** (the caller's first polls): nothing, for a wait of a few microseconds;
2. **yield** (``sched_yield``) until the wait has lasted :data:`YIELD_S`: a descheduled peer gets the core
   at once when ranks outnumber cores;
3. **nap**: sleep :data:`NAP_SHARE` of the time waited so far, at most :data:`MAX_NAP_S`, so the end of a
   wait is noticed late by at most 5 % of its length (plus the kernel's timer slack, ~50 us) and never by
   more than about a millisecond, while the core is free almost all of the time.
"""

from __future__ import annotations

import os
import time

#: Seconds of yielding before a wait naps: an ordinary step's wait (0.1 ms at the digits job's
#: allreduce, longer with ranks oversubscribed) never reaches it.
YIELD_S = 0.002
#: A nap's length as a share of the time waited so far: bounds the delay a nap adds to a wait's end.
NAP_SHARE = 0.05
#: The longest nap, seconds.
MAX_NAP_S = 0.001


class Backoff:
    """Paces one wait's polls (:meth:`pause` between two polls); :meth:`reset` when the wait ended."""

    def __init__(self) -> None:
        self._since: float | None = None

    def pause(self) -> bool:
        """Give the core back once: yield while the wait is young, else nap a share of its length. Whether
        it napped (a poll after a nap is a millisecond or so from the last: a caller that also asks MPI
        every so many polls asks after each nap)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        waited = now - self._since
        if waited < YIELD_S:
            os.sched_yield()
            return False
        time.sleep(min(MAX_NAP_S, waited * NAP_SHARE))
        return True

    def reset(self) -> None:
        """The wait ended: the next one starts by yielding again."""
        self._since = None
