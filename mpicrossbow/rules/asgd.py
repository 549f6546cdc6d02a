"""ASGD — asynchronous SGD through a parameter server (Dean et al. 2012 "Downpour"; SpeeDO async; MXNet-G
``dist_async``).

Who sends what to whom, and when: rank 0 (ranks 0..S-1 with ``servers = S``, each a shard) holds w and does
not train; every τ local steps a worker pushes its progress ``Δ = x − x_pulled`` (summed over its learners)
and adopts the w the server replies with; the server applies
``w ← w + scale · Δ`` as each push arrives, with no barrier and no staleness bound: a slow worker never
holds the others (its late pushes are applied as they come). The protocol is
:mod:`mpicrossbow.rules.parameter_server`. ``scale`` defaults to 1 (each worker's steps count in full, as
Downpour applies gradients); τ = 1 pushes every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import setting
from .parameter_server import ServerConfig, ServerRule
from .registry import RULES


@RULES.register("ASGD")
class ASGD(ServerRule):
    """Asynchronous pushes of Δ every τ steps, applied by the server on arrival."""

    @dataclass(frozen=True)
    class Config(ServerConfig):
        """ASGD hyper-parameters."""

        scale: float = setting(1.0, "the server applies w ← w + scale·Δ (0: 1 / all workers' learners)", ge=0)

    name = "ASGD"
    forgets_workers = True
