"""``RULE = AUTO``'s decision: which synchronous rule reaches the target soonest on this cluster, predicted as
the seconds of a step (the cost model, :mod:`.cost_model`) times the epochs it needs (the statistical side).

**Inputs**, measured by :class:`~.auto.Auto` on every rank while it runs BSP (:class:`Measured`): BSP's wall
seconds per step and the part of it spent in the rule's hooks; the α and β of the link, fitted from two
timed allreduces (a short one and one of the model's bytes) over every rank; γ, the seconds per byte of one
elementwise pass over the parameters; whether the communicator overlaps a collective with compute; the
learners in all (k); and the gradient noise scale where known.

**Throughput.** A step's compute is the running rule's measured step less its communication
(:attr:`Measured.compute_s`); the cost model prices each other candidate's step from it and the fitted link
(:func:`~.cost_model.step_time`); the running rule keeps its measured step, and so does each candidate that
ran earlier in this world (:attr:`Measured.known`): a measured step beats a price, most of all where the link
is not α–β (a token bucket carries a lone allreduce at its burst rate and a step's every one at its
sustained rate).

**Statistical side.** Each candidate's epochs to a target, relative to BSP's at the same k
(:data:`EPOCHS_VS_BSP`), are read from the measured tables of benchmarks/results/epochs_to_target.md (MNIST-1D
CNN, 2 ranks, k = 2 to 16, medians of 3 seeds), interpolated in log2 k, and 1 at k = 1 (one learner: every
rule is plain SGD); past the largest measured k, that k's figure. The table is the run's learning-rate rule's
(``[optim] lr_scaling``, told by :meth:`~.base.Rule.on_lr_scaling`): it moves the ratio more than anything
else measured — at k = 8 LOCALSGD needed 2.35× BSP's epochs with every rate scaled linearly (to 94 %; 4.0× to
80 %), 1.21× with the rate as written (to 80 %). **The gradient noise scale** (read where the loop's probe
keeps it, :meth:`~.base.Rule.on_noise_scale`) is shown beside the decision but does not move it: measured
beside the epochs of two models (benchmarks/results/epochs_to_target.md, 2026-12-04 10:17 and 10:18), the
same B_noise (2.3 and 2.4 learners' batches at k = 2) went with LOCALSGD needing 0.95× BSP's epochs on the
digits MLP and 1.07× on MNIST-1D's CNN, and the larger B_noise (digits at k = 4 and 8) with the fewer extra
epochs. **LOCALSGD's period** is a choice too, where the run's table has a row for it (:func:`offered`):
with the rate as written periods 4, 8 and 16 (measured side by side, 2026-12-03 06:48); with every rate
scaled linearly period 8 only — period 16 missed 94 % at k = 8 and 16 in every seed, and period 4, offered
from that table for a while, took AUTO to 3.03× the best rule's time on the digits job at k = 8, where
period 16 was the fastest (benchmarks/results/links.md, 2026-12-01 13:42).

**Where it is wrong** (docs/rules.md, "AUTO"): models whose averaging rules need other epochs than MNIST-1D's
CNN did; a link that changes after the decision (the decision is made once); stragglers, which the model
prices as the average rank; links of two speeds (one α and β for every rank).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from .cost_model import Cluster, Link, step_time

#: Epochs to the target relative to BSP's, by the run's learning-rate rule (``[optim] lr_scaling``), then
#: candidate label, then k (learners in all); benchmarks/results/epochs_to_target.md. ``linear``: the
#: documented recipe (batch 16, every rate scaled linearly to the 0.2 cap), to 94 %: SMA from "Epochs to 94 %
#: against k — 2026-11-26 23:39" (29.3/27.8, 62.8/30.8, 61.5/31.8), LOCALSGD from "— 2026-12-01 13:30", side
#: by side with BSP (33.0/27.8, 72.5/30.8, 68.9/31.8). ``none``: the cfg's own recipe (batch 32, lr 0.1 as
#: written, 30 epochs): "Epochs to 80%, 85%, 90% against k — 2026-12-03 06:46", every row side by side with
#: BSP; at each k the mean of the ratios over the targets every rule reached in most seeds — 80, 85 and 90 %
#: at k = 2 and 4, 80 % only at k = 8 (two periods missed 85 %). One target alone is coarse: BSP's 8 whole
#: epochs to 80 % at k = 2 cannot tell periods 8 and 16 apart (1.00 both), its 85 and 90 % rows do (1.00 and
#: 1.21 against 1.20 and 1.25). At k = 16 no rule reached 80 % in 30 epochs (2026-12-02 16:01). The table
#: and that file agree (tests/test_rule_choice.py reads it).
EPOCHS_VS_BSP: dict[str, dict[str, dict[int, float]]] = {
    "linear": {
        "SMA": {1: 1.0, 4: 1.05, 8: 2.04, 16: 1.93},
        "LOCALSGD (period 8)": {1: 1.0, 4: 1.19, 8: 2.35, 16: 2.17},
    },
    "none": {
        "SMA": {1: 1.0, 2: 1.43, 4: 1.31, 8: 1.26},
        "LOCALSGD (period 4)": {1: 1.0, 2: 1.12, 4: 1.15, 8: 1.15},
        "LOCALSGD (period 8)": {1: 1.0, 2: 1.07, 4: 1.22, 8: 1.21},
        "LOCALSGD (period 16)": {1: 1.0, 2: 1.15, 4: 1.19, 8: 1.38},
    },
}
#: The table a learning-rate rule without one of its own reads: ``sqrt`` scales the rate with k too.
READS_AS = {"sqrt": "linear"}
#: A move away from the running rule needs a predicted time to target at most this fraction of the running
#: rule's: the cost model's predictions were 0.80-1.20 of the measured steps (benchmarks/scaling_links.py),
#: a link that shapes traffic errs further, and a move costs (the mean model, BSP's optimizer state started
#: again, a window to confirm it). A candidate kept out only by it, never measured, runs one window on trial
#: (:meth:`Decision.on_trial`), and at its end the two measured steps decide with no margin. Another period
#: of the running rule needs no margin and no trial: its step is the running rule's measured compute and
#: measured average at another period, and a trial of it read worse than its price: LOCALSGD at period 16,
#: priced at 0.90x period 8's step on MNIST-1D (0.86x by hand), read 1.23x on trial; on digits at k = 8
#: (0.81x by hand) it read 0.94x (benchmarks/results/links.md, 2026-12-03 06:59 and 07:10).
MARGIN = 0.8
#: The candidates, in the order they are shown: label → (rule, its hyper-parameters).
CANDIDATES: dict[str, tuple[str, dict[str, int]]] = {
    "BSP": ("BSP", {}),
    "SMA": ("SMA", {}),
    "LOCALSGD (period 4)": ("LOCALSGD", {"period": 4}),
    "LOCALSGD (period 8)": ("LOCALSGD", {"period": 8}),
    "LOCALSGD (period 16)": ("LOCALSGD", {"period": 16}),
}


def offered(lr_scaling: str = "none") -> list[str]:
    """The candidates a run under the learning-rate rule ``lr_scaling`` chooses among, in
    :data:`CANDIDATES`' order: BSP and each one whose epochs were measured under that rule
    (:data:`EPOCHS_VS_BSP`); a period without its own row is not priced as another's."""
    table = EPOCHS_VS_BSP[READS_AS.get(lr_scaling, lr_scaling)]
    return [label for label in CANDIDATES if label == "BSP" or label in table]


@dataclass(frozen=True)
class Measured:
    """What the decision reads (module docstring); times in seconds, the largest over the ranks.
    ``step_s`` and ``hooks_s`` are the ``active`` candidate's (BSP at the first decision)."""

    ranks: int
    learners: int
    step_s: float
    hooks_s: float
    link: Link
    nbytes: int
    gamma: float
    overlaps: bool
    noise_scale: float = math.nan
    #: Seconds of one allreduce of the model's bytes, timed with every rank lined up.
    allreduce_s: float = 0.0
    #: The label of the candidate that ran while ``step_s`` was measured.
    active: str = "BSP"
    #: (label, seconds a step) of other candidates, measured while each ran earlier in this world and at
    #: this k: they keep their measured step instead of the model's price.
    known: tuple[tuple[str, float], ...] = ()
    #: How the run's rate scales with k (``[optim] lr_scaling``): which epochs table is read.
    lr_scaling: str = "none"

    def ran(self, label: str) -> bool:
        """Whether ``label``'s step was measured (it runs now, or ran earlier in this world)."""
        return label == self.active or label in dict(self.known)

    @property
    def compute_s(self) -> float:
        """One step's compute: the active rule's step less its communication, which is the seconds in its
        hooks or its share of allreduces per step (every step for BSP and SMA, every H-th for LOCALSGD),
        whichever is less (never below a tenth of the step). The hooks also hold the wait for the slowest
        rank of each step: that wait stays in the compute, which every rule that meets each step pays too."""
        _, hyper = CANDIDATES[self.active]
        share = self.allreduce_s / hyper.get("period", 1)
        return max(self.step_s - min(self.hooks_s, share), 0.1 * self.step_s)


@dataclass(frozen=True)
class Candidate:
    """One candidate's predicted step, epochs relative to BSP's, and their product (BSP = 1)."""

    label: str
    rule: str
    hyper: dict[str, int]
    step_s: float
    epochs: float
    time: float


@dataclass(frozen=True)
class Decision:
    """The candidates, the chosen one first, then soonest first; :attr:`chosen` is the first. ``kept``: the
    soonest candidate, when it was not :data:`MARGIN` × the running rule's time or less and the running
    rule was kept (else empty). ``trial``: the running rule's label when the chosen candidate runs one
    window on trial instead (:meth:`on_trial`)."""

    candidates: tuple[Candidate, ...]
    measured: Measured
    kept: str = ""
    trial: str = ""

    def on_trial(self) -> Decision:
        """This decision with the candidate the margin kept out (``kept``) chosen for one window on trial:
        the model cannot rank two candidates whose predicted times are within its error, so the kept-out
        one's step is measured before the choice is made (:class:`~.auto.Auto`)."""
        first = next(c for c in self.candidates if c.label == self.kept)
        rest = tuple(c for c in self.candidates if c is not first)
        return Decision((first, *rest), self.measured, trial=self.candidates[0].label)

    @property
    def chosen(self) -> Candidate:
        """The candidate predicted to reach the target soonest."""
        return self.candidates[0]

    def line(self) -> str:
        """The decision in one line: each candidate's predicted time to target (BSP = 1), step and epochs,
        then the figures behind them."""
        m = self.measured
        rows = ", ".join(
            f"{c.label} {c.time:.2f} ({c.step_s * 1e3:.3g} ms/step{' measured' if m.ran(c.label) else ''} × "
            f"{c.epochs:.2f} epochs)"
            for c in self.candidates
        )
        noise = f"{m.noise_scale:.4g}" if math.isfinite(m.noise_scale) else "not measured"
        kept = ""
        if self.kept:
            ratio = next(c.time for c in self.candidates if c.label == self.kept) / self.chosen.time
            kept = f" (kept: {self.kept} predicted {ratio:.2f}x its time, a move needs {MARGIN:g}x or less)"
        elif self.trial:
            ratio = self.chosen.time / next(c.time for c in self.candidates if c.label == self.trial)
            kept = (
                f" for one window on trial (predicted {ratio:.2f}x {self.trial}'s time: a move on a price "
                f"needs {MARGIN:g}x or less, so its step is measured first)"
            )
        return (
            f"chose {self.chosen.label}{kept}; time to target relative to BSP: {rows}; from compute "
            f"{m.compute_s * 1e3:.3g} ms/step, allreduce of {m.nbytes / 1e3:.4g} KB over {m.ranks} rank(s) "
            f"α {m.link.alpha * 1e6:.3g} µs β {m.link.beta * 1e9:.3g} ns/B, k = {m.learners}, "
            f"lr_scaling {m.lr_scaling}, B_noise {noise}"
        )


def epochs_vs_bsp(label: str, k: int, lr_scaling: str = "none") -> float:
    """The epochs to the target of the candidate ``label`` relative to BSP's at ``k`` learners in all under
    the learning-rate rule ``lr_scaling`` (:data:`EPOCHS_VS_BSP`), interpolated in log2 k; past the largest
    measured k, that k's; BSP's own is 1."""
    table = EPOCHS_VS_BSP[READS_AS.get(lr_scaling, lr_scaling)].get(label)
    if table is None:
        return 1.0
    ks = sorted(table)
    if k <= ks[0]:
        return table[ks[0]]
    if k >= ks[-1]:
        return table[ks[-1]]
    if k in table:
        return table[k]
    high = next(i for i, at in enumerate(ks) if at >= k)
    a, b = ks[high - 1], ks[high]
    share = (math.log2(k) - math.log2(a)) / (math.log2(b) - math.log2(a))
    return table[a] + share * (table[b] - table[a])


def fit_link(ranks: int, short: tuple[float, float], long: tuple[float, float]) -> Link:
    """α and β from two timed allreduces (``(bytes, seconds)`` each) over ``ranks`` ranks, read as the ring's
    ``2(p−1) α + 2 (p−1)/p · n β``; neither is below 0."""
    if ranks < 2:
        return Link(0.0, 0.0)
    (n_s, t_s), (n_l, t_l) = short, long
    hops, share = 2 * (ranks - 1), 2 * (ranks - 1) / ranks
    beta = max((t_l - t_s) / (share * (n_l - n_s)), 0.0) if n_l > n_s else 0.0
    alpha = max((t_s - share * n_s * beta) / hops, 0.0)
    return Link(alpha, beta)


def choose_rule(
    measured: Measured, labels: Collection[str] | None = None, margin: float = MARGIN
) -> Decision:
    """Price every candidate of ``labels`` (default: all) that the run's learning-rate rule offers
    (:func:`offered`; BSP always priced, as the unit) and order them, soonest first
    (ties: the listed order). The active candidate and those in ``known`` keep their measured steps; the
    others are priced by the cost model. Times are relative to BSP's. The active candidate, where it is one
    of ``labels``, is kept unless the soonest is ``margin`` × its time or less (1: the soonest, as between
    two measured steps), or is another period of the active candidate's rule (the same step, measured,
    priced at another period: :data:`MARGIN`)."""
    cluster = Cluster(
        "measured",
        gpus_per_node=measured.ranks,
        intra=measured.link,
        inter=measured.link,
        gamma=measured.gamma,
        overlaps=measured.overlaps,
    )
    shown = [
        label for label in offered(measured.lr_scaling) if label == "BSP" or labels is None or label in labels
    ]
    steps, known = {}, dict(measured.known)
    for label in shown:
        rule, hyper = CANDIDATES[label]
        if label == measured.active:
            steps[label] = measured.step_s
        elif label in known:
            steps[label] = known[label]
        else:
            period = hyper.get("period", 1)
            steps[label] = step_time(
                rule, measured.ranks, measured.compute_s, measured.nbytes, cluster, period=period
            ).seconds
    found = []
    for label in shown:
        rule, hyper = CANDIDATES[label]
        epochs = epochs_vs_bsp(label, measured.learners, measured.lr_scaling)
        time = steps[label] * epochs / max(steps["BSP"], 1e-12)
        found.append(Candidate(label, rule, hyper, steps[label], epochs, time))
    order = sorted(
        (i for i in range(len(found)) if labels is None or found[i].label in labels),
        key=lambda i: (found[i].time, i),
    )
    ranked = [found[i] for i in order]
    running = next((c for c in ranked if c.label == measured.active), None)
    if running is None or ranked[0] is running or ranked[0].rule == running.rule:
        return Decision(tuple(ranked), measured)
    if ranked[0].time <= margin * running.time:
        return Decision(tuple(ranked), measured)
    rest = tuple(c for c in ranked if c is not running)
    return Decision((running, *rest), measured, kept=ranked[0].label)
