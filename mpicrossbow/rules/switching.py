"""A rule that starts as BSP and hands over to a later synchronous rule at a step every rank reaches at once:
the one switching path, shared by post-local SGD (:mod:`.postlocalsgd`) and ``RULE=AUTO`` (:mod:`.auto`).

Who sends what to whom, at the switch (after the exchange of BSP's last step):

* one allreduce (MAX) of (step, −step, checksum, −checksum) over every rank: a rank at another step is a
  RuntimeError; replicas that differ (they should not under BSP) are logged once by rank 0;
* BSP stops watching backward, and the BatchNorm statistics become the mean over every learner (exact);
* the later rule is bound: its ``bind`` broadcasts rank 0's learner 0, which every replica already equals.

Before the switch every hook goes to BSP, after it to the later rule. Checkpoints hold the phase (the switch
step, or None) and the active rule's state; a checkpoint taken after the switch binds the later rule when it
is loaded and keeps the replicas it restored, so a resumed run continues exactly. What decides the switch
(an epoch, a learning-rate drop, a measurement) and which rule comes after is the subclass's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..comm.base import Communicator, ReduceOp
from .base import Rule
from .bsp import BSP

if TYPE_CHECKING:
    from ..pool.replica_view import ReplicaView

log = logging.getLogger(__name__)


class SwitchingRule(Rule):
    """BSP, then ``later`` from :attr:`switched_at` on. Subclasses build :attr:`bsp` and :attr:`later` in
    ``__init__`` (``later`` may be replaced before the switch) and call :meth:`switch`."""

    bsp: BSP
    later: Rule
    #: The first step the later rule ran (None: BSP is still active).
    switched_at: int | None = None

    @property
    def active(self) -> Rule:
        """The rule that exchanges now: BSP before the switch, the later rule from it on."""
        return self.bsp if self.switched_at is None else self.later

    @property
    def averages_gradients(self) -> bool:
        """What the active rule says: BSP's grad mode before the switch, the later rule's after it."""
        return self.active.averages_gradients

    @property
    def averages_gradients_throughout(self) -> bool:
        """Whether BSP and the later rule both average gradients."""
        return self.bsp.averages_gradients and self.later.averages_gradients

    def bind(self, comm: Communicator, pool: ReplicaView) -> Rule:
        """Bind BSP (every learner starts from rank 0's learner 0); the later rule waits for the switch."""
        self.comm, self.pool = comm, pool
        self._bind(self.bsp)
        return self

    def _bind(self, rule: Rule) -> None:
        """Bind ``rule`` over this rule's communicator and pool with its patience and tick (collective)."""
        assert self.comm is not None and self.pool is not None
        rule.patience, rule.tick = self.patience, self.tick
        rule.bind(self.comm, self.pool)

    def switch(self, step: int) -> None:
        """Every rank at once: check the step and the replicas, stop BSP, bind :attr:`later` at ``step``."""
        assert self.comm is not None and self.pool is not None
        self._agree(step)
        self.bsp.finish()  # no more gradient buckets during backward
        self.bsp.sync_state()  # BatchNorm statistics: the mean over every learner, exactly
        self._bind(self.later)
        self.switched_at = step

    def _agree(self, step: int, equal: bool = True) -> None:
        """One allreduce (MAX) of (step, −step, checksum, −checksum) over every rank (module docstring);
        ``equal``: the replicas should be equal now (BSP's), so a difference is logged."""
        assert self.comm is not None and self.pool is not None
        sums = [float(learner.params.double().sum()) for learner in self.pool.learners]
        high, low, most, least = self.comm.exact.allreduce_scalars(
            [float(step), -float(step), max(sums), -min(sums)], op=ReduceOp.MAX
        )
        if high != -low:
            raise RuntimeError(
                f"{self.name}: the ranks switch at different steps ({-low:g} to {high:g}); the switch must "
                "be a function of the step count alone"
            )
        if equal and most != -least and self.comm.rank == 0:
            log.warning(
                "%s: the replicas differ at the switch (weight sums %r to %r); %s starts every learner from "
                "rank 0's learner 0",
                self.name,
                -least,
                most,
                self.later.name,
            )

    # ------------------------------------------------------------------ hooks
    def on_gradients(self, step: int) -> None:
        """The active rule's (BSP: the gradient allreduce; SMA: the corrections)."""
        self.active.on_gradients(step)

    def on_lr_change(self, old: float, new: float) -> None:
        """The active rule's."""
        self.active.on_lr_change(old, new)

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """Elastic training lost ranks: the active rule's (each follows the survivors). The later rule is
        bound at the switch over whoever is there then; when the dropped step was the switch, restoring the
        state before it goes back to BSP, every survivor alike (:meth:`load_state_dict`)."""
        self.active.on_rebind(lost)

    def on_resize(self) -> None:
        """The active rule's."""
        self.active.on_resize()

    def sync_state(self) -> None:
        """The active rule's (BSP: BatchNorm statistics averaged; SMA: the step in flight completed)."""
        self.active.sync_state()

    def eval_params(self) -> torch.Tensor | None:
        """The active rule's model to validate (BSP: learner 0's own; SMA: z; EASGD: the centre)."""
        return self.active.eval_params()

    def local_consensus(self) -> torch.Tensor | None:
        """The active rule's."""
        return self.active.local_consensus()

    def finish(self) -> None:
        """The active rule's."""
        self.active.finish()

    def rearm(self) -> None:
        """The active rule's."""
        self.active.rearm()

    def agree_pause(self, wanted: bool) -> bool:
        """The active rule's."""
        return self.active.agree_pause(wanted)

    @property
    def in_flight(self) -> int:
        """The active rule's."""
        return self.active.in_flight

    # ------------------------------------------------------------ checkpoints
    def phase_state(self) -> dict[str, Any]:
        """The phase and the active rule's state (``bsp`` before the switch, ``then`` after it)."""
        if self.switched_at is None:
            return {"switched_at": None, "bsp": self.bsp.state_dict()}
        return {"switched_at": self.switched_at, "then": self.later.state_dict()}

    def load_phase(self, state: Mapping[str, Any], later: Rule | None = None) -> None:
        """Restore the phase and the active rule's state: the state's rule is BSP before its switch, else
        ``later`` (default :attr:`later`; a subclass whose later rule is chosen at run time names it).
        Collective when that is not the rule running now (every rank restores the same checkpoint at once):
        the running rule finishes and the state's rule is bound, keeping the replicas the pool restored."""
        at = state.get("switched_at")
        target = self.bsp if at is None else (later or self.later)
        live = self.active
        if live is not target:
            live.finish()
            self._adopt(target)
        if at is not None:
            self.later = target
        self.switched_at = None if at is None else int(at)
        target.load_state_dict(state.get("bsp", {}) if at is None else state["then"])

    def _adopt(self, rule: Rule) -> None:
        """Bind ``rule`` (collective) and give every learner back the weights and buffers it had: a restored
        checkpoint's replicas, which bind's broadcast would replace."""
        assert self.comm is not None and self.pool is not None
        kept = [(learner.params.clone(), learner.buffers.clone()) for learner in self.pool.learners]
        self._bind(rule)
        for learner, (params, buffers) in zip(self.pool.learners, kept, strict=True):
            learner.params.copy_(params)
            learner.buffers.copy_(buffers)
