"""AUTO — the framework picks the exchange rule: BSP while it measures the cluster, then the synchronous rule
predicted to reach the target soonest (:mod:`.rule_choice`: the cost model's step times × the epochs each
rule needs), switched to through post-local SGD's path (:mod:`.switching`).

Who sends what to whom, and when:

* **Steps 0 … measure_steps − 1** are BSP's (its default settings: every hook goes to BSP). From step
  :data:`UNTIMED_STEPS` on, each rank times its steps (from one exchange's end to the
  next) and the part spent in the rule's hooks.
* **After the exchange of step measure_steps − 1**, every rank at once: a short allreduce (256 bytes) and
  one of the model's flat parameters, each once untimed and :data:`REPEATS` times timed (the fastest), and
  a local elementwise pass timed for γ; one allreduce (MAX) of the five figures, so every rank decides from
  the same numbers and alike; :func:`~.rule_choice.choose_rule`. Rank 0 logs the decision in one line (every
  candidate's predicted time and the figures behind it). If the choice is not BSP, the switch
  (:class:`~.switching.SwitchingRule`) binds the chosen rule from the next step on.
* **After the decision** the chosen rule runs as it does on its own. The decision is taken once.

Checkpoints hold the decision and the phase: a run resumed after the decision runs the rule it chose,
exactly; one resumed before it measures again. ``candidates`` restricts the choice (``BSP,SMA``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..comm.base import Communicator, ReduceOp
from ..config.fields import setting
from ..errors import ConfigError
from .base import Rule
from .bsp import BSP
from .registry import RULES
from .rule_choice import CANDIDATES, Decision, Measured, choose_rule, fit_link
from .switching import SwitchingRule

if TYPE_CHECKING:
    from ..pool.replica_view import ReplicaView

log = logging.getLogger(__name__)

#: Steps at the start that are not timed (first steps pay for allocation and caches); fewer when
#: ``measure_steps`` leaves no more than that.
UNTIMED_STEPS = 3
#: Timed repetitions of each allreduce and pass at the decision; the fastest counts (what the link and the
#: memory can do: a slower repetition met a rank descheduled or another job's traffic, one-sided noise).
REPEATS = 10
#: Bytes of the short allreduce that prices the link's latency.
SHORT_BYTES = 256


@RULES.register("AUTO")
class Auto(SwitchingRule):
    """BSP while measuring, then the rule the cost model and the epochs table predict soonest."""

    @dataclass(frozen=True)
    class Config:
        """AUTO hyper-parameters."""

        measure_steps: int = setting(
            20,
            "BSP steps before the decision (the first 3 are not timed); a run that ends sooner stays BSP",
            ge=2,
        )
        candidates: str = setting(
            "BSP,SMA,LOCALSGD", "the rules to choose from, comma-separated: any of BSP, SMA, LOCALSGD"
        )

    name = "AUTO"

    def __init__(self, **hyper: Any) -> None:
        super().__init__(**hyper)
        offered = {rule: label for label, (rule, _) in CANDIDATES.items()}
        wanted = [name.strip().upper() for name in self.hyper.candidates.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in offered]
        if unknown or not wanted:
            raise ConfigError(
                f"[rule] candidates = {self.hyper.candidates}: AUTO chooses among {', '.join(offered)}"
            )
        self.hyper = dataclasses.replace(self.hyper, candidates=",".join(dict.fromkeys(wanted)))
        self.bsp = BSP()
        #: label → the rule built for it (BSP's is :attr:`bsp`).
        self.options: dict[str, Rule] = {
            offered[name]: self.bsp if name == "BSP" else RULES.get(name)(**CANDIDATES[offered[name]][1])
            for name in dict.fromkeys(wanted)
        }
        self.later = next(iter(self.options.values()))
        self.switched_at = None
        #: The chosen candidate's label once decided (None: still measuring).
        self.decided: str | None = None
        self.decision: Decision | None = None
        self._steps = 0  # timed steps
        self._step_s = 0.0
        self._hooks_s = 0.0
        self._mark: float | None = None  # the end of the last exchange
        self._in_hooks = 0.0
        self._warned = False

    @property
    def needs_gradients(self) -> bool:
        """True when any candidate exchanges gradients (BSP's grad mode): the model must expose them."""
        return any(rule.needs_gradients for rule in self.options.values())

    @property
    def averages_gradients_throughout(self) -> bool:
        """Whether every candidate averages gradients (SMA and LOCALSGD do not)."""
        return all(rule.averages_gradients for rule in self.options.values())

    def check_learners(self, k: int) -> None:
        """Every candidate's check for ``k`` learners in all."""
        for rule in self.options.values():
            rule.check_learners(k)

    def bind(self, comm: Communicator, pool: ReplicaView) -> Rule:
        """Bind BSP; say when the decision comes."""
        super().bind(comm, pool)
        if comm.rank == 0 and self.decided is None:
            log.info(
                "%s: BSP for %d step(s) while measuring, then the soonest of %s",
                self.name,
                self.hyper.measure_steps,
                ", ".join(self.options),
            )
        return self

    # ------------------------------------------------------------------ hooks
    def on_gradients(self, step: int) -> None:
        """The active rule's, timed while measuring."""
        before = time.perf_counter()
        self.active.on_gradients(step)
        self._in_hooks += time.perf_counter() - before

    def exchange(self, step: int) -> None:
        """The active rule's exchange; while measuring, time the step; after the last one measured, decide."""
        before = time.perf_counter()
        self.active.exchange(step)
        end = time.perf_counter()
        if self.decided is not None:
            return
        if step >= min(UNTIMED_STEPS, self.hyper.measure_steps - 1) and self._mark is not None:
            self._steps += 1
            self._step_s += end - self._mark
            self._hooks_s += self._in_hooks + end - before
        self._mark, self._in_hooks = end, 0.0
        if step + 1 >= self.hyper.measure_steps:
            self._decide(step + 1)

    def _decide(self, step: int) -> None:
        """Every rank at once: measure the link and γ, agree on the figures, choose, switch if not BSP."""
        assert self.comm is not None and self.pool is not None
        params = self.pool.learners[0].params
        short = _timed_allreduce(self.comm, torch.zeros(SHORT_BYTES // 4, device=params.device))
        long = _timed_allreduce(self.comm, torch.zeros_like(params))
        gamma = _pass_seconds(params) / max(1, params.numel() * params.element_size())
        steps = max(1, self._steps)
        figures = [self._step_s / steps, self._hooks_s / steps, short, long, gamma]
        step_s, hooks_s, short, long, gamma = self.comm.exact.allreduce_scalars(figures, op=ReduceOp.MAX)
        nbytes = params.numel() * params.element_size()
        measured = Measured(
            ranks=self.comm.size,
            learners=self.world_learners,
            step_s=step_s,
            hooks_s=hooks_s,
            link=fit_link(self.comm.size, (SHORT_BYTES, short), (nbytes, long)),
            nbytes=nbytes,
            gamma=gamma,
            overlaps=self.comm.overlaps,
            allreduce_s=long,
        )
        self._choose(decide_among(measured, self.options), step)

    def _choose(self, decision: Decision, step: int) -> None:
        """Record ``decision`` and switch to its choice at ``step`` (nothing to switch for BSP)."""
        assert self.comm is not None
        self.decision, self.decided = decision, decision.chosen.label
        if self.comm.rank == 0:
            log.info("%s at step %d: %s", self.name, step, decision.line())
        if self.options[self.decided] is not self.bsp:
            self.later = self.options[self.decided]
            self.switch(step)

    def finish(self) -> None:
        """The active rule's; rank 0 warns once when the run ended before the decision."""
        self.active.finish()
        if self.decided is None and not self._warned and self.comm is not None and self.comm.rank == 0:
            log.warning(
                "%s: the run ended before the decision at step %d, so it was BSP throughout; lower [rule] "
                "measure_steps or train longer",
                self.name,
                self.hyper.measure_steps,
            )
            self._warned = True

    # ---------------------------------------------------------------- records
    def run_record(self) -> dict[str, Any]:
        """The decision for metrics.h5: the chosen label, its step, and each candidate's predicted row
        (label, seconds a step, epochs relative to BSP, time relative to BSP)."""
        if self.decision is None:
            return {}
        return {
            "rule_auto_choice": self.decided,
            "rule_auto_step": self.switched_at if self.switched_at is not None else self.hyper.measure_steps,
            "rule_auto_candidates": "; ".join(c.label for c in self.decision.candidates),
            "rule_auto_predicted": [[c.step_s, c.epochs, c.time] for c in self.decision.candidates],
            "rule_auto_line": self.decision.line(),
        }

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The decision (None while measuring) and the phase with the active rule's state."""
        return {**super().state_dict(), "decided": self.decided, **self.phase_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the decision and the phase (collective when the phase changes); a checkpoint taken while
        measuring measures again from the resumed step."""
        decided = state.get("decided")
        if decided is not None and decided not in self.options:
            raise ConfigError(
                f"the checkpoint's AUTO chose {decided}, which [rule] candidates = {self.hyper.candidates} "
                "leaves out: resume with the candidates it was saved with"
            )
        self.decided = decided
        if decided is not None and self.options[decided] is not self.bsp:
            self.later = self.options[decided]
        self._steps, self._step_s, self._hooks_s, self._mark = 0, 0.0, 0.0, None
        self.load_phase(state)


def decide_among(measured: Measured, options: Mapping[str, Rule]) -> Decision:
    """:func:`~.rule_choice.choose_rule`, keeping the candidates in ``options``."""
    full = choose_rule(measured)
    return Decision(tuple(c for c in full.candidates if c.label in options), measured)


def _timed_allreduce(comm: Communicator, buffer: torch.Tensor) -> float:
    """The fastest of :data:`REPEATS` blocking allreduces of ``buffer`` (after one untimed), in seconds."""
    comm.allreduce(buffer).wait()
    times = []
    for _ in range(REPEATS):
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        before = time.perf_counter()
        comm.allreduce(buffer).wait()
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        times.append(time.perf_counter() - before)
    return min(times)


def _pass_seconds(params: torch.Tensor) -> float:
    """The fastest of :data:`REPEATS` elementwise passes over a copy of ``params`` (γ times its bytes)."""
    copy = params.clone()
    times = []
    for _ in range(REPEATS):
        before = time.perf_counter()
        copy.mul_(1.0)
        if copy.is_cuda:
            torch.cuda.synchronize(copy.device)
        times.append(time.perf_counter() - before)
    return min(times)
