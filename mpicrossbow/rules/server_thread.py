"""A parameter-server shard served from a background thread of a training rank (``placement = colocated``).

BytePS and PS-lite place a server beside the workers of every machine instead of on machines of its own; here
every rank hosts one shard of the server state in a thread, so every rank trains and no device idles. The
thread runs the same :class:`~mpicrossbow.rules.parameter_server.ParameterServer` loop a server rank runs,
on a communicator of its own (the rule's split off, so its traffic never meets the rule's other messages),
which needs ``MPI_THREAD_MULTIPLE``. It serves until every worker said done — at the run's end, or when the
workers drain for a snapshot — and is started again after a snapshot. An exception in the thread is kept and
raised in the training thread at its next push or wait, so it ends the job like any failure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ServerThread:
    """Serving rounds of a hosted shard (:meth:`start` … :meth:`join`; ``serve`` is one round) and the
    failure of one, if any."""

    def __init__(self, serve: Callable[[], None], rank: int) -> None:
        self.serve, self.rank = serve, rank
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether a serving round has been started and not joined."""
        return self._thread is not None

    def start(self) -> None:
        """Serve until every worker is done (a no-op while a round runs)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._serve, name=f"server-shard-rank{self.rank}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.serve()
        except BaseException as exc:  # kept for the training thread: it raises it
            self._error = exc

    def check(self) -> None:
        """Raise what the serving thread raised, in the calling (training) thread."""
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the parameter-server shard of rank {self.rank} failed: {error}") from error

    def join(self) -> None:
        """Wait for the round to end (every worker done), then raise its failure if it had one."""
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(timeout=0.1)
                self.check()
            self._thread = None
        self.check()
