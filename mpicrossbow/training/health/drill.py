"""Where an ``[inject]`` drill fires in training: around the step, and inside its exchange — only on the rank
a drill targets, so every other run (and every other rank of a drilled one) has none of it in its hot path.

* :class:`Drill` wraps the run's :class:`~mpicrossbow.training.run.window.StepWindow`: as a step starts,
  the :class:`~.faults.FaultInjector` fires its step's action (raise, exit, kill, hang, signal), and for
  ``kill_in_exchange`` arms the trap.
* :class:`ExchangeTrap` is the communicator the rule is bound to on that rank: it forwards every operation,
  and once armed, SIGKILLs the rank right after the next operation started — the step's first exchange
  operation, so a collective dies half-done on the other ranks (what elastic training must undo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ...comm.base import Communicator, Handle, ReduceOp
from ...comm.forwarding import ForwardingCommunicator
from ..run.window import ForwardingWindow, StepWindow
from .faults import FaultInjector

T = TypeVar("T")


class ExchangeTrap(ForwardingCommunicator):
    """``inner`` with a trap: once armed, the next operation started springs it, then it disarms. Splits are
    the inner ones, untrapped (the drill is on the rule's own communicator)."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.trap: Callable[[], None] | None = None

    def arm(self, trap: Callable[[], None]) -> None:
        """Spring ``trap`` right after the next operation has started (a blocking one: completed)."""
        self.trap = trap

    def _spring(self) -> None:
        """An operation has started: spring the trap once, if armed."""
        trap, self.trap = self.trap, None
        if trap is not None:
            trap()

    def _started(self, handle: Handle) -> Handle:
        self._spring()
        return handle

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """The inner allreduce, then the trap if armed."""
        return self._started(self.inner.allreduce(tensor, op, async_op))

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """The inner allreduce_mean (the learners' average: LOCALSGD's, BSP's one after backward), then the
        trap if armed."""
        self.inner.allreduce_mean(tensor, count)
        self._spring()

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """The inner broadcast, then the trap if armed."""
        return self._started(self.inner.broadcast(tensor, root, async_op))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """The inner isend, then the trap if armed."""
        return self._started(self.inner.isend(tensor, dst, tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """The inner irecv, then the trap if armed."""
        return self._started(self.inner.irecv(tensor, src, tag))

    @property
    def exact(self) -> Communicator:
        """The inner communicator's exact one: the trap stays with this one."""
        return self.inner.exact

    def close(self) -> None:
        """Nothing: the session closes the inner communicator."""


def trapped(comm: Communicator, faults: FaultInjector) -> Communicator:
    """The communicator the rule is bound to: ``comm``, or on the rank of a ``kill_in_exchange`` drill
    ``comm`` with the trap that kills the rank inside a step's exchange."""
    return ExchangeTrap(comm) if faults.drills_exchange else comm


def drilled(window: StepWindow, faults: FaultInjector, rule_comm: Communicator | None) -> StepWindow:
    """The run's ``window``, with this rank's drill around it when it has one that fires at a step
    (``rule_comm``: the rule's communicator, an :class:`ExchangeTrap` on a ``kill_in_exchange`` drill's
    rank)."""
    if not faults.drills_steps:
        return window
    return Drill(window, faults, rule_comm if isinstance(rule_comm, ExchangeTrap) else None)


class Drill(ForwardingWindow):
    """``inner`` with this rank's drill fired as its step starts (and its exchange trap armed)."""

    def __init__(self, inner: StepWindow, faults: FaultInjector, trap: ExchangeTrap | None) -> None:
        super().__init__(inner)
        self.faults, self.trap = faults, trap

    def step(self, run: Callable[[], float], step: int) -> float:
        """The drill's action if due at ``step``, then the inner step."""
        self.faults.at_step(step)
        spring = self.faults.in_exchange(step)
        if spring is not None:
            if self.trap is None:  # no exchange on this rank: as ``kill``
                spring()
            else:
                self.trap.arm(spring)
        return self.inner.step(run, step)
