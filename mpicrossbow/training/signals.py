"""Stop on SIGTERM/SIGUSR1 (Slurm's warning before the time limit): every rank stops at the same step.

A handler only sets a flag. The ranks agree through one non-blocking 1-value MAX allreduce every
``SIGNAL_CHECK_STEPS`` steps, started at one check and read at the next, so the decision is the same
everywhere and nobody waits for it; the loop then saves a checkpoint and ends.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch

from ..comm.base import Communicator, Handle, ReduceOp

#: Steps between the ranks' agreements on whether a SIGTERM/SIGUSR1 arrived (the reaction time in steps).
SIGNAL_CHECK_STEPS = 10

#: The signals that ask for a checkpoint and a clean stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class SignalStop:
    """Installs the handlers; ``stop(step)`` is true on every rank once any rank was signalled."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.received: int | None = None
        self._flag = torch.zeros(1, dtype=torch.float64)
        self._pending: list[Handle] = []
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def __call__(self, step: int) -> bool:
        """Whether to stop after ``step`` (collective every SIGNAL_CHECK_STEPS steps, non-blocking)."""
        if step % SIGNAL_CHECK_STEPS:
            return False
        if self._pending:
            self._pending.pop().wait()
            if self._flag.item() > 0:
                return True
        self._flag.fill_(1.0 if self.received is not None else 0.0)
        self._pending.append(self.comm.allreduce(self._flag, ReduceOp.MAX, async_op=True))
        return False

    def close(self) -> None:
        """Complete the last agreement (every rank started it) and restore the default handlers."""
        for handle in self._pending:
            handle.wait()
        self._pending.clear()
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
