"""SSP — stale synchronous parallel (Ho et al., NIPS 2013; MXNet-G ``dist_ssync``, SpeeDO --maxAdvance).

Who sends what to whom, and when: as asynchronous SGD through the parameter server (ranks 0..S-1 hold w; every
τ steps a worker pushes ``Δ = x − x_pulled`` and adopts the w in the reply), plus a clock per worker (its
pushes): the server holds a worker's reply while its clock c exceeds the slowest training worker's by more
than ``staleness`` s (``c − c_min > s``), so no worker runs more than s pushes ahead. s = 0 is bulk
synchronous: with τ = 1 and ``scale`` = 1/workers (the default) every worker's step is the mean of all
workers' updates on the same w — BSP gradient mode, momentum included (the mean of the workers' momentum
steps is the momentum step of the mean gradient). Protocol: :mod:`mpicrossbow.rules.parameter_server`.

The clock ticks once per push, i.e. every τ local steps: τ > 1 is Ho et al.'s clock as a unit of work (the
bound s then allows s·τ steps of advance) and pays the server round trip once per τ steps. SSP bounds
staleness, not waiting: behind a *persistent* straggler the others settle at its pace once they are s clocks
ahead, so its gain over BSP comes from the exchanges it saves, not from outrunning the straggler.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import setting
from .parameter_server import ServerConfig, ServerRule, StalenessBound
from .registry import RULES


@RULES.register("SSP")
class SSP(ServerRule):
    """Parameter-server SGD whose workers stay within ``staleness`` pushes of the slowest."""

    @dataclass(frozen=True)
    class Config(ServerConfig):
        """SSP hyper-parameters."""

        staleness: int = setting(2, "s: pushes a worker may run ahead of the slowest (0: BSP)", ge=0)

    name = "SSP"
    forgets_workers = True

    def policy(self) -> StalenessBound:
        """Hold replies beyond the bound s."""
        return StalenessBound(self.hyper.staleness)
