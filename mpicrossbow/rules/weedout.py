"""WEEDOUT — weed-out SGD (SpeeDO ``--weedout n``).

Who sends what to whom, and when: ASGD through the parameter server (ranks 0..S-1 hold w; every τ steps a
worker pushes ``Δ = x − x_pulled`` and adopts the w in the reply), but a push is merged only if it is fresh:
if more than ``K = max(n, workers)`` pushes reached the server since this worker last pulled (its result was
computed from weights K or more reports old — the sender is not among the last K reporters), the server
**discards** it and the worker restarts from the current w, which the reply carries either way. With
every worker equally fast each is exactly ``workers`` reports old, so nothing is discarded; a straggler's
stale work is. Protocol: :mod:`mpicrossbow.rules.parameter_server`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import setting
from .parameter_server import ParameterServer, Policy, ServerConfig, ServerRule
from .registry import RULES


class DiscardStale(Policy):
    """Merge a push only if at most ``max(n, workers)`` pushes arrived since its sender last pulled (the
    workers still there: after an elastic loss the bound follows the survivors)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def accept(self, server: ParameterServer, r: int) -> bool:
        """``received − pulled_at[r] ≤ max(n, workers)`` (``received`` counts this push)."""
        live = len(server.workers) - len(server.lost)
        return server.received - server.pulled_at[r] <= max(self.n, live)


@RULES.register("WEEDOUT")
class WeedOut(ServerRule):
    """Asynchronous merges that weed out pushes computed from too-old weights."""

    @dataclass(frozen=True)
    class Config(ServerConfig):
        """WEEDOUT hyper-parameters."""

        n: int = setting(0, "merge only pushes at most max(n, workers) reports old", ge=0)

    name = "WEEDOUT"
    #: Elastic training: the freshness bound counts the workers still there.
    forgets_workers = True

    def policy(self) -> DiscardStale:
        """SpeeDO's weed-out."""
        return DiscardStale(self.hyper.n)
