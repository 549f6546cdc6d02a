"""AUTO — the framework picks the exchange rule: it measures the cluster under the candidate that exchanges
least (LOCALSGD), then runs the synchronous rule predicted to reach the target soonest
(:mod:`.rule_choice`: the cost model's step times × the epochs each rule needs), moved to through post-local
SGD's path (:mod:`.switching`) or by averaging the replicas; measured again, and chosen again, when the
cluster changes.

Who sends what to whom, and when:

* **Windows of measure_steps steps.** Each rank times its steps (from one exchange's end to the next) and
  the part spent in the rule's hooks, from the :data:`UNTIMED_STEPS`-th step of each window on.
* **The first window** runs the measuring rule: LOCALSGD when it is a candidate, whose window holds two of
  its averages and whose other steps exchange nothing, so measuring costs what the cheapest candidate costs
  (BSP's steps over a slow link made the measuring a fifth of a short run: benchmarks/results/links.md);
  else BSP. After its last exchange, every rank at once: a short allreduce (256 bytes) once untimed and
  :data:`REPEATS` times timed, which lines the ranks up; the model's bytes priced by the fastest of the
  window's own averages under LOCALSGD (the smallest over the ranks), else by :data:`LONG_REPEATS` timed
  allreduces of the model's flat parameters (the fastest counts); a local elementwise pass timed for γ; one
  allreduce (MAX) of the figures (MIN of the averages), so every rank decides from the same numbers, alike;
  :func:`~.rule_choice.choose_rule`, the measuring rule keeping its measured step and the others priced from
  its compute. Rank 0 logs the decision in one line (every candidate's predicted time and the figures behind
  it). If the choice is not the measuring rule, every rank moves to it from the next step on: from BSP
  through the switch (:class:`~.switching.SwitchingRule`), from LOCALSGD at once: the window ended on its
  average, so every learner holds the mean model and buffers already (below).
* **A trial.** Where the soonest candidate was kept out only by the margin (:data:`~.rule_choice.MARGIN`:
  predicted sooner, but within the model's error; never another period of the running rule, which is taken
  on its price) and its step was never measured in this world, the model
  cannot rank the two: every rank moves to it for one window on trial, and at the window's end the choice
  is made again between the two measured steps, with no margin (the issue's "short timed trials"; on two
  fast links the model priced BSP at 0.84× LOCALSGD's time, and LOCALSGD, kept, took 1.27× BSP's time to
  80 %: benchmarks/results/links.md). A run resumed inside the window on trial ends it alike.
* **Every later window** ends with one allreduce (MAX) of three numbers: the window's step and hook
  seconds and whether the world or the learner count changed (an elastic loss or replacement,
  ``learners = auto``). With ``recheck`` on, a step :data:`DRIFT`× slower or faster than predicted for
  :data:`SUSTAINED` windows in a row (a link that slowed, another job's traffic), or such a change,
  measures the link again and decides again from the running rule's figures. A new choice is switched to
  at once on every rank: the running rule finishes, every learner takes the mean model and buffers of all
  k learners (model averaging leaves the replicas apart; LOCALSGD, whose windows end on its own average,
  has just done it), and the new rule is bound.

Checkpoints hold the choice, the phase and the window's position: a run resumed after a decision runs the
rule it chose, exactly; one resumed before the first decision measures again under the rule it measured
with. ``candidates`` restricts the
choice (``BSP,SMA``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..comm.base import Communicator, ReduceOp
from ..config.fields import setting
from ..errors import ConfigError
from .base import Rule
from .bsp import BSP
from .registry import RULES
from .rule_choice import CANDIDATES, MARGIN, Decision, Measured, choose_rule, fit_link, offered
from .switching import SwitchingRule

if TYPE_CHECKING:
    from ..pool.replica_view import ReplicaView

log = logging.getLogger(__name__)

#: Steps at the start that are not timed (first steps pay for allocation and caches); fewer when
#: ``measure_steps`` leaves no more than that.
UNTIMED_STEPS = 3
#: Timed repetitions of the short allreduce and the pass at the decision; the fastest counts (what the link
#: and the memory can do: a slower repetition met a rank descheduled or another job's traffic, one-sided
#: noise).
REPEATS = 5
#: Timed allreduces of the model's bytes at a decision under BSP (the fastest counts): each costs one BSP
#: exchange, and the window's own exchanges have already opened the connections, so none goes untimed.
#: Under LOCALSGD the window's own averages price them instead.
LONG_REPEATS = 2
#: The candidate measured under when it is offered: it exchanges every 8th step, the others every step.
MEASURING = "LOCALSGD (period 8)"
#: Bytes of the short allreduce that prices the link's latency.
SHORT_BYTES = 256
#: How far a window's step may stray from the prediction (either way) before it counts as drift.
DRIFT = 2.0
#: Windows in a row that must drift before AUTO measures and decides again; the first window after a
#: decision needs only one: a prediction missed at once was measured wrong (a link that shapes traffic, such
#: as a token bucket, carries a lone allreduce at its burst rate and a step's every one at its sustained
#: rate), not met by a passing load.
SUSTAINED = 2


@RULES.register("AUTO")
class Auto(SwitchingRule):
    """LOCALSGD (else BSP) while measuring, then the rule the cost model and the epochs table predict
    soonest; chosen again when the cluster changes."""

    @dataclass(frozen=True)
    class Config:
        """AUTO hyper-parameters."""

        measure_steps: int = setting(
            10,
            "steps of a measuring window (the first 3 are not timed; under LOCALSGD a window holds two of "
            "its averages or more); a run that ends before the first decision stays on the measuring rule",
            ge=2,
        )
        candidates: str = setting(
            "BSP,SMA,LOCALSGD",
            "the rules to choose from, comma-separated: any of BSP, SMA, LOCALSGD (at each period the run's "
            "epochs table measured)",
        )
        recheck: bool = setting(
            True,
            "decide again when a window's step strays 2x from the prediction two windows in a row, after an "
            "elastic loss or replacement, and when learners = auto changes k",
        )

    name = "AUTO"

    def __init__(self, **hyper: Any) -> None:
        super().__init__(**hyper)
        offered: dict[str, list[str]] = {}  # rule → the labels of its candidates (a rule at some settings)
        for label, (rule, _) in CANDIDATES.items():
            offered.setdefault(rule, []).append(label)
        wanted = [name.strip().upper() for name in self.hyper.candidates.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in offered]
        if unknown or not wanted:
            raise ConfigError(
                f"[rule] candidates = {self.hyper.candidates}: AUTO chooses among {', '.join(offered)}"
            )
        self.hyper = dataclasses.replace(self.hyper, candidates=",".join(dict.fromkeys(wanted)))
        self.bsp = BSP()
        #: label → the rule built for it (BSP's is :attr:`bsp`), in :data:`CANDIDATES`' order.
        self.options: dict[str, Rule] = {
            label: self.bsp if rule == "BSP" else RULES.get(rule)(**hyper)
            for label, (rule, hyper) in CANDIDATES.items()
            if rule in wanted
        }
        #: The rule measured under before the first decision (module docstring).
        self.measuring = MEASURING if MEASURING in self.options else "BSP"
        self.later = self.options.get(self.measuring, next(iter(self.options.values())))
        self.switched_at = None
        #: The running choice's label (None: measuring for the first decision).
        self.decided: str | None = None
        #: The last decision, and every decision's (step, label, predicted seconds a step).
        self.decision: Decision | None = None
        self.decisions: list[tuple[int, str, float]] = []
        #: While a candidate runs one window on trial, the label of the rule it replaced (else empty).
        self.trial = ""
        self._window = 0  # the step the current window started at
        self._drifted = 0  # windows in a row that drifted
        self._changed = False  # the world or k changed since the last decision
        self._steps, self._step_s, self._hooks_s, self._in_hooks = 0, 0.0, 0.0, 0.0
        self._mark: float | None = None  # the end of the last exchange
        #: The fastest exchange of the window that averaged the model (inf: none timed; rules with a period).
        self._average_s = float("inf")
        #: label → seconds a step, agreed over the ranks, of each candidate's last window run in this world,
        #: at this k and since the last drift (not checkpointed: a resumed run measures afresh).
        self.measured: dict[str, float] = {}
        self._warned = False
        #: The run's ``[optim] lr_scaling`` (:meth:`on_lr_scaling`; the default until told). A rank that
        #: joins a running job untold takes the survivors' from the handover: every rank decides alike.
        self.lr_scaling, self._told = "none", False
        #: Where the run's gradient noise scale is read (:meth:`on_noise_scale`; NaN until told).
        self._noise_scale: Callable[[], float] = lambda: math.nan

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

    def on_lr_scaling(self, scaling: str) -> None:
        """Keep the run's learning-rate rule: the epochs table the decision reads."""
        self.lr_scaling, self._told = scaling, True

    def on_noise_scale(self, read: Callable[[], float]) -> None:
        """Keep where the gradient noise scale is read: each decision shows it (:mod:`.rule_choice`: shown,
        not used)."""
        self._noise_scale = read

    def bind(self, comm: Communicator, pool: ReplicaView) -> Rule:
        """Bind the measuring rule (BSP's phase, or LOCALSGD's from step 0: every learner starts from rank
        0's learner 0 either way); say when the decision comes."""
        if self.measuring == "BSP":
            super().bind(comm, pool)
        else:
            self.comm, self.pool = comm, pool
            self.later = self.options[self.measuring]
            self._bind(self.later)
            self.switched_at = 0
        if comm.rank == 0 and self.decided is None:
            log.info(
                "%s: %s for %d step(s) while measuring, then the soonest of %s",
                self.name,
                self.measuring,
                self.first_decision(),
                ", ".join(label for label in offered(self.lr_scaling) if label in self.options),
            )
        return self

    @property
    def running(self) -> str:
        """The label of the candidate exchanging now (BSP's phase is "BSP")."""
        if self.active is self.bsp:
            return "BSP"
        return next(label for label, rule in self.options.items() if rule is self.active)

    # ------------------------------------------------------------------ hooks
    def on_gradients(self, step: int) -> None:
        """The active rule's, timed."""
        before = time.perf_counter()
        self.active.on_gradients(step)
        self._in_hooks += time.perf_counter() - before

    def exchange(self, step: int) -> None:
        """The active rule's exchange, timed; after a window's last step, decide (first) or check."""
        before = time.perf_counter()
        self.active.exchange(step)
        end = time.perf_counter()
        into, length = step - self._window, self.window_length()
        if into >= min(UNTIMED_STEPS, length - 1) and self._mark is not None:
            self._steps += 1
            self._step_s += end - self._mark
            self._hooks_s += self._in_hooks + end - before
            if self._period() > 1 and (step + 1) % self._period() == 0:
                self._average_s = min(self._average_s, end - before)
        self._mark, self._in_hooks = end, 0.0
        if into + 1 >= length and (step + 1) % self._period() == 0:
            self._window_ends(step + 1)

    def window_length(self) -> int:
        """The fewest steps of the current window: ``measure_steps``, or under a rule that exchanges every
        H-th step enough for its timed steps to hold two of its exchanges or more (a window between two of
        LOCALSGD's averages would time none and read as drift). Such a window ends on one of the rule's
        exchanges, when the ranks have just met: its closing allreduce then waits for no straggler (one in
        the middle of a period would make every rank wait for the slowest, a meeting LOCALSGD skips)."""
        if self._period() == 1:
            return self.hyper.measure_steps
        return UNTIMED_STEPS + max(self.hyper.measure_steps - UNTIMED_STEPS, 2 * self._period())

    def first_decision(self) -> int:
        """The step of the first decision: the measuring window's end, on one of its rule's exchanges."""
        return -(-self.window_length() // self._period()) * self._period()

    def _period(self) -> int:
        """Steps between two exchanges of the running candidate (1: every step)."""
        return CANDIDATES[self.running][1].get("period", 1)

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """The active rule's; the next window's end decides again (the world changed)."""
        self.active.on_rebind(lost)
        self._changed = True

    def on_resize(self) -> None:
        """The active rule's; the next window's end decides again (k changed)."""
        self.active.on_resize()
        self._changed = True

    def _window_ends(self, step: int) -> None:
        """The first window: decide. A later one: agree on its figures and decide again if they drifted or
        the world changed (module docstring). Then a new window starts at ``step``."""
        assert self.comm is not None
        if self._steps == 0:  # a restore (elastic recovery) left nothing timed: the next window decides
            self._window = step
            return
        step_s, hooks_s = self._step_s / self._steps, self._hooks_s / self._steps
        if self.decided is None:
            self._decide(step, step_s, hooks_s)
        elif self.hyper.recheck or self.trial:
            step_s, hooks_s, changed = self.comm.exact.allreduce_scalars(
                [step_s, hooks_s, float(self._changed)], op=ReduceOp.MAX
            )
            expected = self.decisions[-1][2]
            drift = step_s / expected if expected > 0 and step_s > 0 else 1.0
            self._drifted = self._drifted + 1 if max(drift, 1 / drift) > DRIFT else 0
            fresh = self._window == self.decisions[-1][0]  # the first window of the last decision
            if self.comm.rank == 0:
                log.debug(
                    "%s: steps %d-%d took %.3g ms/step, %.2gx the %.3g predicted",
                    self.name,
                    self._window,
                    step - 1,
                    step_s * 1e3,
                    drift,
                    expected * 1e3,
                )
            if changed:
                self.trial = ""  # what it would be compared with was measured in another world
            if self.trial:  # the trial's step against the rule it replaced, both measured
                self._decide(step, step_s, hooks_s, f"{self.running}'s window on trial ended")
            elif changed or self._drifted >= (1 if fresh else SUSTAINED):
                self.measured.clear()  # the others' steps were measured before what changed
                why = f"steps {drift:.2g}x as predicted" if not changed else "the world or k changed"
                self._decide(step, step_s, hooks_s, why)
            else:
                self.measured[self.running] = step_s
        self._window, self._steps, self._step_s, self._hooks_s = step, 0, 0.0, 0.0
        self._average_s = float("inf")

    def _decide(self, step: int, step_s: float, hooks_s: float, reason: str = "") -> None:
        """Every rank at once: measure the link and γ, agree on the figures, choose, switch if the choice is
        not the running rule.

        Under a rule that averages the model every H-th step (LOCALSGD) the window's averages were
        model-sized allreduces already: the fastest of them, on the rank that waited least for the others
        (the smallest over the ranks), prices the model's bytes, and no allreduce of them is added (two cost
        a seventh of the digits job's time to target over a 30 mbit link: benchmarks/results/links.md). It
        holds the learners' local mean and copy too, so it errs slow, towards the running rule. At the first
        decision only: a rank whose peer's data had crossed the link while it still computed finishes its
        average at once, so on a slow link the fastest average can miss the transfer (after node2's link
        fell to 10 mbit, 0.44 ms for the digits MLP's 104.5 KB, and AUTO moved to BSP and back:
        benchmarks/results/link_slowdown.md). The first decision's error is caught by the trial window (a
        priced BSP is measured before it is taken); a later decision times the allreduces of the model with
        the ranks lined up instead."""
        assert self.comm is not None and self.pool is not None
        params = self.pool.learners[0].params
        short = _timed_allreduce(self.comm, torch.zeros(SHORT_BYTES // 4, device=params.device), REPEATS)
        # every rank ran the same steps of the same rule: all timed averages, or none did; they price the
        # link at the first decision only (docstring)
        averaged = self._average_s < float("inf") and not reason
        if averaged:
            long = self._average_s
        else:
            long = _timed_allreduce(self.comm, torch.zeros_like(params), LONG_REPEATS, untimed=False)
        gamma = _pass_seconds(params) / max(1, params.numel() * params.element_size())
        figures = [step_s, hooks_s, short, gamma]
        step_s, hooks_s, short, gamma = self.comm.exact.allreduce_scalars(figures, op=ReduceOp.MAX)
        (long,) = self.comm.exact.allreduce_scalars([long], op=ReduceOp.MIN if averaged else ReduceOp.MAX)
        nbytes = params.numel() * params.element_size()
        self.measured[self.running] = step_s
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
            active=self.running,
            lr_scaling=self.lr_scaling,
            noise_scale=self._noise_scale(),
            known=tuple((label, s) for label, s in self.measured.items() if label != self.running),
        )
        decision = choose_rule(measured, self.options, margin=1.0 if self.trial else MARGIN)
        self.trial = ""
        if decision.kept and not measured.ran(decision.kept):  # within the model's error: measure it
            decision = decision.on_trial()
            self.trial = decision.trial
        running = self.running
        self.decision, self.decided = decision, decision.chosen.label
        self.decisions.append((step, decision.chosen.label, decision.chosen.step_s))
        self._drifted, self._changed = 0, False
        if self.comm.rank == 0:
            again = f" (again: {reason})" if reason else ""
            log.info("%s at step %d%s: %s", self.name, step, again, decision.line())
        if decision.chosen.label != running:
            self._move(step, self.options[decision.chosen.label])

    def _move(self, step: int, target: Rule) -> None:
        """Every rank at once, from the running rule to ``target`` at ``step``: from BSP's first phase the
        switching path; from another rule (LOCALSGD measuring, or a later choice), the same step check, then
        every learner takes the mean model and buffers of all k (already done where the running rule has
        just averaged them: LOCALSGD, whose windows end on its average) and ``target`` is bound. A target that
        averages gradients (BSP) keeps its replicas equal only from equal optimizer state, which model
        averaging left apart on each learner: every learner's momentum starts again from zero."""
        assert self.comm is not None and self.pool is not None
        if self.switched_at is None:
            self.later = target
            self.switch(step)
            return
        running = self.active
        averaged = running.averaged_before(step)  # LOCALSGD's windows end on its average: equal already
        self._agree(step, equal=running is self.bsp or averaged)
        running.finish()
        if not averaged:
            running.sync_state()
            self.average("params")
            self.average("buffers")
        if target.averages_gradients:
            _zero_optimizer_state(self.pool)
        self._bind(target)
        self.later, self.switched_at = target, step

    def sync_state(self) -> None:
        """The active rule's; a validation (or the final model) follows: :meth:`on_pause`."""
        self.active.sync_state()
        self.on_pause()

    def on_pause(self) -> None:
        """Work that is not a step follows (a validation, an epoch's end, a checkpoint): the time until the
        next step's end is not a step's, so that step is left out of the window's timing (a validation
        inside a window of seven timed steps had made BSP's measured step 1.4x its own:
        benchmarks/results/links.md)."""
        self._mark = None

    def finish(self) -> None:
        """The active rule's; rank 0 warns once when the run ended before the first decision."""
        self.active.finish()
        if self.decided is None and not self._warned and self.comm is not None and self.comm.rank == 0:
            log.warning(
                "%s: the run ended before the decision at step %d, so it was %s throughout; lower [rule] "
                "measure_steps or train longer",
                self.name,
                self.first_decision(),
                self.measuring,
            )
            self._warned = True

    # ---------------------------------------------------------------- records
    def run_record(self) -> dict[str, Any]:
        """The decisions for metrics.h5: the running choice; one row per decision (step, index of its
        label in ``rule_auto_labels``, predicted seconds a step); the last decision's candidates with their
        predicted rows (seconds a step, epochs and time relative to BSP) and its line."""
        if self.decision is None:
            return {}
        labels = list(CANDIDATES)
        return {
            "rule_auto_choice": self.decided,
            "rule_auto_labels": "; ".join(labels),
            "rule_auto_decisions": [[step, labels.index(label), s] for step, label, s in self.decisions],
            "rule_auto_candidates": "; ".join(c.label for c in self.decision.candidates),
            "rule_auto_predicted": [[c.step_s, c.epochs, c.time] for c in self.decision.candidates],
            "rule_auto_line": self.decision.line(),
        }

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The choice (None while measuring first), the decisions so far, the window's start and drift,
        and the phase with the active rule's state."""
        return {
            **super().state_dict(),
            "decided": self.decided,
            "decisions": [list(row) for row in self.decisions],
            "window": self._window,
            "drifted": self._drifted,
            "trial": self.trial,
            "lr_scaling": self.lr_scaling,
            **self.phase_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the choice and the phase (collective when the running rule changes); a checkpoint taken
        while measuring first measures again from the resumed step."""
        decided = state.get("decided")
        if decided is not None and decided not in self.options:
            raise ConfigError(
                f"the checkpoint's AUTO chose {decided}, which [rule] candidates = {self.hyper.candidates} "
                "leaves out: resume with the candidates it was saved with"
            )
        if decided is None and state.get("switched_at") is not None and self.measuring == "BSP":
            raise ConfigError(
                f"the checkpoint's AUTO was measuring under {MEASURING}, which [rule] candidates = "
                f"{self.hyper.candidates} leaves out: resume with the candidates it was saved with"
            )
        self.decided = decided
        self.decisions = [(int(a), str(b), float(c)) for a, b, c in state.get("decisions", [])]
        self._window, self._drifted = int(state.get("window", 0)), int(state.get("drifted", 0))
        self.trial = str(state.get("trial", ""))
        if not self._told:
            self.lr_scaling = str(state.get("lr_scaling", self.lr_scaling))
        self._steps, self._step_s, self._hooks_s, self._mark = 0, 0.0, 0.0, None
        self._average_s = float("inf")
        self.measured = {}
        self.load_phase(state, self.options[decided] if decided is not None else None)


def _timed_allreduce(comm: Communicator, buffer: torch.Tensor, repeats: int, untimed: bool = True) -> float:
    """The fastest of ``repeats`` blocking allreduces of ``buffer`` (after one untimed, with ``untimed``), in
    seconds."""
    if untimed:
        comm.allreduce(buffer).wait()
    times = []
    for _ in range(repeats):
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        before = time.perf_counter()
        comm.allreduce(buffer).wait()
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        times.append(time.perf_counter() - before)
    return min(times)


def _zero_optimizer_state(pool: ReplicaView) -> None:
    """Every floating state tensor of every optimizer of ``pool`` (momentum, Adam's moments) set to zero in
    place (the storage a captured CUDA graph reads stays); step counts, equal on every learner, are kept."""
    for optimizer in pool.optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.zero_()


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
