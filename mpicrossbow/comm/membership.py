"""Membership: who is in an elastic job now, as one versioned value.

A :class:`~mpicrossbow.launch.world.World` is frozen at start; an elastic job's ranks change when one is lost.
What changes is held here instead: the version (0 at start, one more per recovery), the members by their
rank at start (``ranks``, in order: member ``i`` is rank ``i`` now), and this process's place among them.
Everything that must follow the world — the communicator's rank and size, who writes the run folder — reads
it from the current value, never from a copy taken at start.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Membership:
    """The ranks of an elastic job at one version."""

    #: 0 at start, one more at every recovery.
    version: int
    #: The members' ranks at start, in their current rank order.
    ranks: tuple[int, ...]
    #: This process's rank now (its index in ``ranks``).
    rank: int
    #: Each member's host, in rank order, where known (elastic training over MPI): where a replacement for a
    #: lost member is started (``[elastic] replace``); empty where nobody asked.
    hosts: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Members now."""
        return len(self.ranks)

    @property
    def original_rank(self) -> int:
        """This process's rank at start (what its logs and traceback file are named after)."""
        return self.ranks[self.rank]

    def lost_since(self, before: Membership) -> tuple[int, ...]:
        """The ranks of ``before`` (numbered as then) that are not members now."""
        kept = set(self.ranks)
        return tuple(i for i, r in enumerate(before.ranks) if r not in kept)

    def __str__(self) -> str:
        return f"membership v{self.version}: {self.size} rank(s), start ranks {list(self.ranks)}"
