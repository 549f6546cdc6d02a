"""PSGD — partially synchronous SGD (SpeeDO ``--maxAdvance``).

Who sends what to whom, and when: ASGD through the parameter server (ranks 0..S-1 hold w; every τ steps a
worker pushes ``Δ = x − x_pulled``, the server merges ``w ← w + scale·Δ`` on arrival and replies with w),
except that when a worker's push puts it ``max_advance`` or more pushes ahead of the slowest worker still
training, its reply is held **until every other training worker has pushed once more** (SpeeDO's rule: the
fast worker stops until everyone else has reported again), instead of SSP's "until the slowest is within s".
Protocol: :mod:`mpicrossbow.rules.parameter_server`. Elastic training: a lost worker counts as done, so a
worker held until it pushes again is released when the server forgets it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import setting
from .parameter_server import ParameterServer, Policy, ServerConfig, ServerRule
from .registry import RULES


class WaitForEveryone(Policy):
    """Hold a worker ``max_advance`` ahead until each other training worker has pushed again."""

    def __init__(self, max_advance: int) -> None:
        self.max_advance = max_advance
        self.waiting_for: dict[int, dict[int, int]] = {}

    def hold(self, server: ParameterServer, r: int) -> None:
        """Too far ahead: remember every other worker's clock now."""
        if server.clock[r] - server.c_min() >= self.max_advance:
            self.waiting_for[r] = {q: server.clock[q] for q in server.workers if q != r}

    def releasable(self, server: ParameterServer, r: int) -> bool:
        """Not held, or every other worker has pushed since (or finished)."""
        clocks = self.waiting_for.get(r)
        if clocks is None:
            return True
        if all(q in server.done or server.clock[q] > c for q, c in clocks.items()):
            del self.waiting_for[r]
            return True
        return False


@RULES.register("PSGD")
class PSGD(ServerRule):
    """Asynchronous merges; a worker ``max_advance`` ahead waits until all others reported again."""

    @dataclass(frozen=True)
    class Config(ServerConfig):
        """PSGD hyper-parameters."""

        max_advance: int = setting(4, "pushes ahead of the slowest that make a worker wait for all", ge=1)

    name = "PSGD"
    #: Elastic training: a lost worker counts as done (ParameterServer.forget), so a hold waiting for it to
    #: push again is released at once.
    forgets_workers = True

    def policy(self) -> WaitForEveryone:
        """SpeeDO's partial synchrony."""
        return WaitForEveryone(self.hyper.max_advance)

    def shard_policy(self, shard: int) -> Policy:
        """Shard 0 alone holds replies. Whether a worker is held depends on the order pushes arrive in,
        which differs between shards: two shards holding two workers, each until the other pushes again,
        would wait for ever. A worker waits for every shard's reply, so shard 0's holds bound it anyway."""
        return self.policy() if shard == 0 else Policy()
