"""StepWindow: how the loop's steps, and the collectives between them, run — the loop's one seam for fault
tolerance.

The training loop never asks whether its run survives a lost rank. It hands every step, every collective
between steps (validation, the epoch's statistics, the signal check) and its end to the window the session
built: :class:`Unguarded` when a lost rank ends the job (the default: each call runs as it is, at no cost),
or :class:`~mpicrossbow.training.elastic.fault_tolerance.FaultTolerance` (``[elastic] enabled``), which
commits steps in windows and redoes a collective over the survivors. A drill (``[inject]``) wraps either one
(:class:`~mpicrossbow.training.health.drill.Drill`), so drills stay out of every run that has none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from ...launch.world import World
from ..checkpoints.pause_orders import PauseOrders

T = TypeVar("T")


class StepWindow(ABC):
    """Runs a rank's steps and the collectives between them; what happens when a rank is lost is its own."""

    @abstractmethod
    def step(self, run: Callable[[], float], step: int) -> float:
        """Run ``run`` (one train_step; returns its exchange seconds) as step ``step``; the exchange seconds
        counted (0.0 when the step was dropped)."""

    @abstractmethod
    def collective(self, fn: Callable[..., T], what: str) -> Callable[..., T]:
        """``fn`` (a collective between steps, named ``what`` in the log) as this window runs it."""

    @abstractmethod
    def flush(self, where: str) -> bool:
        """Before ``where`` (a checkpoint): every step so far is final; False when some were dropped."""

    def begin(self, step: int) -> None:  # noqa: B027 - optional hook
        """Step ``step`` starts, its parts to follow in :meth:`guard` and :meth:`end` (the embedded API's
        steps, split around the user's ``optimizer.step()``; :meth:`step` is all three)."""

    def guard(self, work: Callable[[], T], where: str, redo: Callable[[], None] | None = None) -> T | None:
        """``work()`` as a part of the open step (``where`` names it in the log); None when the window
        drops it. ``redo``: ``work`` may run again after a loss met inside it, once ``redo()`` put back
        what it reads (the step's own gradients: :meth:`redoes`)."""
        return work()

    def members(self, world_mpi: Any) -> Any:
        """The mpi4py communicator a collective run through :meth:`collective` goes over when it is not the
        rule's: ``world_mpi`` (the world's; None without MPI) where a lost rank ends the job; a window that
        survives one gives its members' own, which a loss revokes, so such a collective fails on every
        survivor and is redone over them instead of waiting on the lost rank or ending the job."""
        return world_mpi

    def redoes(self) -> bool:
        """Whether a step's gradient exchange that meets a lost rank runs again over the survivors, from
        the gradients each computed (``guard``'s ``redo``), instead of the step being dropped: the step
        (``train_step``, the embedded API's hooks) then keeps a copy of them before the exchange."""
        return False

    def end(self, step: int) -> bool:
        """Step ``step`` ended; False when it was dropped."""
        return True

    def trains(self) -> bool:
        """Whether the open step's update still counts: False when it will be dropped whatever it applies,
        so the embedded API keeps the user's ``optimizer.step()`` from applying a gradient that was never
        exchanged (a rank healing from a peer keeps no copy to undo it with)."""
        return True

    def amend(self) -> None:  # noqa: B027 - optional hook
        """The state changed between steps (the loop set a new learning rate, and told the rule): a step
        dropped later must not take the change back."""

    def add_state(self, part: Any) -> None:  # noqa: B027 - optional hook
        """One more object (with ``state_dict``/``load_state_dict``) that a dropped step restores."""

    def before_step(self, position: Callable[[], dict[str, Any]]) -> None:  # noqa: B027 - optional hook
        """At the start of a step, before anything of it ran (``position``: where training stands, what a
        rank joining now starts from)."""

    def on_recovery(self, hook: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Call ``hook`` after every recovery from a lost rank (none without fault tolerance)."""

    def settle(self, where: str) -> None:  # noqa: B027 - optional hook
        """After the rule's ``finish``, before the run's last collectives: the ranks that go on are known."""

    def pause_orders(self, world: World) -> PauseOrders:
        """The control plane of an asynchronous run's coordinated snapshots over ``world``."""
        return PauseOrders(world)


class Unguarded(StepWindow):
    """A run where a lost rank ends the job: each step and collective runs as it is."""

    def step(self, run: Callable[[], float], step: int) -> float:
        """``run()``."""
        return run()

    def collective(self, fn: Callable[..., T], what: str) -> Callable[..., T]:
        """``fn`` itself."""
        return fn

    def flush(self, where: str) -> bool:
        """Every step is final as it ends."""
        return True


class ForwardingWindow(StepWindow):
    """``inner`` with every call passed on unchanged: the base of a window that adds one thing around a run's
    window (a drill's action as its step starts, a replica group's return at a step's boundary) and leaves
    the rest to it."""

    def __init__(self, inner: StepWindow) -> None:
        self.inner = inner

    def step(self, run: Callable[[], float], step: int) -> float:
        """As the inner window."""
        return self.inner.step(run, step)

    def collective(self, fn: Callable[..., T], what: str) -> Callable[..., T]:
        """As the inner window."""
        return self.inner.collective(fn, what)

    def flush(self, where: str) -> bool:
        """As the inner window."""
        return self.inner.flush(where)

    def begin(self, step: int) -> None:
        """As the inner window."""
        self.inner.begin(step)

    def guard(self, work: Callable[[], T], where: str, redo: Callable[[], None] | None = None) -> T | None:
        """As the inner window."""
        return self.inner.guard(work, where, redo)

    def members(self, world_mpi: Any) -> Any:
        """The inner window's."""
        return self.inner.members(world_mpi)

    def redoes(self) -> bool:
        """The inner window's."""
        return self.inner.redoes()

    def end(self, step: int) -> bool:
        """As the inner window."""
        return self.inner.end(step)

    def trains(self) -> bool:
        """The inner window's."""
        return self.inner.trains()

    def amend(self) -> None:
        """As the inner window."""
        self.inner.amend()

    def add_state(self, part: Any) -> None:
        """As the inner window."""
        self.inner.add_state(part)

    def before_step(self, position: Callable[[], dict[str, Any]]) -> None:
        """As the inner window."""
        self.inner.before_step(position)

    def on_recovery(self, hook: Callable[[], None]) -> None:
        """As the inner window."""
        self.inner.on_recovery(hook)

    def settle(self, where: str) -> None:
        """As the inner window."""
        self.inner.settle(where)

    def pause_orders(self, world: World) -> PauseOrders:
        """As the inner window."""
        return self.inner.pause_orders(world)
