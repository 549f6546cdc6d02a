"""Fault injection, built into the library (as torchft does) so tests and drills can break a job on purpose.

``[inject] rank = r, step = s, action = ...`` makes rank r fail when it starts step s (counted from 0 over the
whole run): ``raise`` an exception, ``exit`` (``sys.exit(3)``, as user code might), ``kill`` itself
with SIGKILL, ``hang`` forever, make its loss ``nan``, ``kill_in_save``: SIGKILL itself in the middle
of writing the checkpoint taken once s steps are done (its file written, not yet renamed into place), or
``signal``: send itself SIGUSR1, as Slurm does before a time limit (a drill of the checkpoint-and-stop), or
``kill_in_exchange``: SIGKILL itself inside step s's exchange, once its first operation started (the rule's
communicator on that rank springs it: :mod:`.drill`). A rank that serves instead
of training (a parameter server, an EASGD centre) takes no steps: it fails once it has answered s requests.
Every other rank is unaffected; what the job does next is what the tests check.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import torch

from ...config import InjectSection, SessionSection

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The exception ``action = raise`` throws."""


class FaultInjector:
    """This rank's part of ``[inject]``: does nothing unless this rank is the one that fails."""

    def __init__(self, section: InjectSection, rank: int) -> None:
        self.section = section
        self.active = section.rank == rank
        #: A serving rank's fault has fired (:meth:`at_served` is asked between every sweep).
        self.fired = False

    @property
    def drills_steps(self) -> bool:
        """Whether this rank's drill fires as a step starts or inside its exchange (:class:`.drill.Drill`
        then wraps the run's steps); the rest fire from the NaN guard, the checkpoint writer or a serving
        loop."""
        return self.active and self.section.action in (
            "raise",
            "exit",
            "kill",
            "hang",
            "signal",
            "kill_in_exchange",
        )

    @property
    def drills_exchange(self) -> bool:
        """Whether this rank's drill kills it inside a step's exchange (the rule's communicator is then an
        :class:`.drill.ExchangeTrap`)."""
        return self.active and self.section.action == "kill_in_exchange"

    def _due(self, step: int, *actions: str) -> bool:
        return self.active and step == self.section.step and self.section.action in actions

    def at_step(self, step: int) -> None:
        """Called as ``step`` starts: raise, exit, kill or hang if this is the fault's rank and step."""
        if not self._due(step, "raise", "exit", "kill", "hang", "signal"):
            return
        action = self.section.action
        log.warning("[inject] %s at step %d (injected)", action, step)
        if action == "signal":
            os.kill(os.getpid(), signal.SIGUSR1)
            return
        if action == "raise":
            raise InjectedFault(f"injected fault at step {step} ([inject] action = raise)")
        if action == "exit":
            sys.exit(3)  # as user code calling exit() would: the launcher still names the rank
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(1)

    def at_served(self, served: int) -> None:
        """Called by a serving rank (a parameter server, an EASGD centre: it takes no steps) between sweeps of
        its requests, ``served`` of them answered so far: the step's actions fire once ``served`` reaches
        ``[inject] step``, once."""
        if not self.active or self.fired or served < self.section.step:
            return
        if self.section.action in ("raise", "exit", "kill", "hang", "signal"):
            self.fired = True
            log.warning("[inject] a serving rank after %d request(s) served:", served)
            self.at_step(self.section.step)

    def poison(self, step: int, losses: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """``action = nan``: after the step's backward, learner 0's loss and gradient become NaN."""
        if self._due(step, "nan"):
            log.warning("[inject] nan loss at step %d (injected)", step)
            losses[0].fill_(float("nan"))
            grads[0].fill_(float("nan"))

    def in_exchange(self, step: int) -> Callable[[], None] | None:
        """``action = kill_in_exchange``: a hook that SIGKILLs this rank, for the rule's communicator to
        spring right after the step's first exchange operation started (:class:`.drill.ExchangeTrap`)."""
        if not self._due(step, "kill_in_exchange"):
            return None

        def kill() -> None:
            log.warning("[inject] kill in the exchange of step %d (injected)", step)
            os.kill(os.getpid(), signal.SIGKILL)

        return kill

    def in_save(self, step: int) -> Callable[[], None] | None:
        """``action = kill_in_save``: a hook that SIGKILLs this rank before its checkpoint file is renamed."""
        if not self._due(step, "kill_in_save"):
            return None
        return lambda: os.kill(os.getpid(), signal.SIGKILL)


class Straggler:
    """``[session] slow_ranks``: this rank sleeps after every step from ``slow_from_step`` on, a fixed
    ``slow_seconds`` plus ``(slow_factor − 1)`` × the step's own time — a straggler on demand, for tests,
    soaks and benchmarks (a drill slowed only where it needs to be waits no longer than it must). With
    ``whole`` (``slow_while_short``: the world's start size), only while the world is smaller than that: a
    replacement drill's survivors are slowed from the loss until the replacement joined, however long it
    takes to start on a loaded machine, and not after."""

    def __init__(
        self,
        ranks: tuple[int, ...],
        seconds: float,
        factor: float,
        rank: int,
        from_step: int = 0,
        whole: int = 0,
    ) -> None:
        slowed = rank in ranks
        self.delay = seconds if slowed else 0.0
        self.stretch = factor - 1.0 if slowed else 0.0
        self.from_step = from_step
        self.whole = whole
        #: Seconds of sleep injected on this rank so far.
        self.injected_seconds = 0.0

    @classmethod
    def of(cls, session: SessionSection, rank: int, size: int) -> Straggler:
        """The straggler ``[session]`` asks for on start rank ``rank`` of a world of ``size``."""
        whole = size if session.slow_while_short else 0
        factor, start = session.slow_factor, session.slow_from_step
        return cls(session.slow_ranks, session.slow_seconds, factor, rank, start, whole)

    def after_step(self, step_start: float, step: int, size: int = 0) -> None:
        """Sleep as configured after step ``step`` (its index in the run, from 0), which started at
        ``step_start`` (``time.perf_counter()``), in a world of ``size`` ranks now."""
        if not (self.delay or self.stretch) or step < self.from_step or size >= self.whole > 0:
            return
        pause = self.delay + self.stretch * (time.perf_counter() - step_start)
        time.sleep(pause)
        self.injected_seconds += pause
