"""RULE=AUTO's decision (mpicrossbow/rules/rule_choice.py) on figures given by hand: which rule it picks where
the allreduce is negligible, where it dominates, and where a communicator hides it behind compute; the link
fit and the epochs table it reads."""

from __future__ import annotations

import dataclasses
import math

import pytest

from conftest import REPO
from mpicrossbow.errors import ConfigError
from mpicrossbow.rules import RULES
from mpicrossbow.rules.cost_model import Link, ring_allreduce
from mpicrossbow.rules.rule_choice import (
    CANDIDATES,
    EPOCHS_VS_BSP,
    MARGIN,
    Measured,
    choose_rule,
    epochs_vs_bsp,
    fit_link,
    offered,
)

pytestmark = pytest.mark.quick

#: 1 µs, 1 GB/s; a model of 1 MB.
LINK, NBYTES = Link(1e-6, 1e-9), 1_000_000


def measured(compute: float, allreduce: float, overlaps: bool = False, k: int = 2) -> Measured:
    """Figures of a 2-rank BSP whose step is ``compute`` plus an exposed ``allreduce``, every rate scaled
    linearly with k (the documented recipe's epochs table)."""
    return Measured(
        ranks=2,
        learners=k,
        step_s=compute + allreduce,
        hooks_s=allreduce,
        link=Link(0.0, allreduce / NBYTES),  # the ring over 2 ranks: n β
        nbytes=NBYTES,
        gamma=0.0,
        overlaps=overlaps,
        allreduce_s=allreduce,
        lr_scaling="linear",
    )


def test_a_negligible_allreduce_keeps_bsp_which_needs_the_fewest_epochs() -> None:
    decision = choose_rule(measured(compute=0.010, allreduce=0.0001))
    assert decision.chosen.label == "BSP" and decision.chosen.time == 1.0
    assert [c.label for c in decision.candidates] == ["BSP", "SMA", "LOCALSGD (period 8)"]


def test_a_period_is_offered_only_under_the_learning_rate_rule_that_measured_its_epochs() -> None:
    """The rate as written (none) measured LOCALSGD at periods 4, 8 and 16; the linear table period 8 only
    (period 16 missed 94 % at k = 8): a period without its own row is not priced as another's."""
    assert offered("linear") == offered("sqrt") == ["BSP", "SMA", "LOCALSGD (period 8)"]
    assert offered("none") == list(CANDIDATES)
    linear = choose_rule(measured(compute=0.001, allreduce=0.030))
    assert {c.label for c in linear.candidates} == set(offered("linear"))


def test_a_step_the_allreduce_dominates_takes_the_longer_period_where_its_epochs_are_as_few() -> None:
    """The digits MLP over a 30 mbit link at k = 2, the rate as written (benchmarks/results/links.md,
    2026-12-03): 1.4 ms of compute, 27 ms a model allreduce, LOCALSGD at period 8 measured; period 16
    needs as many epochs at k = 2 and pays half the averages, so it is taken; at k = 8, where it needs
    1.38x BSP's epochs against period 8's 1.21x, the step's saving does not pay for them."""
    under_8 = dataclasses.replace(
        measured(compute=0.0014, allreduce=0.027), lr_scaling="none", active="LOCALSGD (period 8)",
        step_s=0.0014 + 0.027 / 8, hooks_s=0.027 / 8,
    )  # fmt: skip
    chosen = choose_rule(under_8).chosen
    assert chosen.label == "LOCALSGD (period 16)" and chosen.step_s == pytest.approx(0.0014 + 0.027 / 16)
    compute_bound = dataclasses.replace(under_8, learners=8, step_s=0.010 + 0.001 / 8, hooks_s=0.001 / 8,
                                        allreduce_s=0.001)  # fmt: skip
    times = {c.label: c.time for c in choose_rule(compute_bound).candidates}
    assert times["LOCALSGD (period 16)"] > times["LOCALSGD (period 8)"]


def test_an_allreduce_that_dominates_the_step_picks_local_sgd() -> None:
    """Allreduce 4× the compute: LOCALSGD pays it every 8th step and wins despite 1.1× BSP's epochs."""
    decision = choose_rule(measured(compute=0.005, allreduce=0.020))
    chosen = decision.chosen
    assert chosen.label == "LOCALSGD (period 8)" and chosen.hyper == {"period": 8}
    assert chosen.step_s == pytest.approx(0.005 + 0.020 / 8)
    assert chosen.time == pytest.approx(0.0075 * epochs_vs_bsp("LOCALSGD (period 8)", 2, "linear") / 0.025)


def test_a_communicator_that_overlaps_makes_sma_hide_an_allreduce_as_long_as_compute() -> None:
    """SMA's allreduce runs beside the next step's compute: its step is the compute alone, BSP's twice it."""
    decision = choose_rule(measured(compute=0.010, allreduce=0.010, overlaps=True))
    assert decision.chosen.label == "SMA"
    assert decision.chosen.step_s == pytest.approx(0.010)
    blocking = choose_rule(measured(compute=0.010, allreduce=0.010, overlaps=False))
    assert blocking.chosen.label == "LOCALSGD (period 8)"  # nothing hidden: the period pays


def test_compute_is_the_step_less_the_allreduce_when_the_hooks_also_waited_for_a_slow_rank() -> None:
    """BSP's hooks hold the wait for the slowest rank too: only the allreduce's own time is taken off."""
    waited = Measured(2, 2, 0.010, 0.006, LINK, NBYTES, 0.0, False, allreduce_s=0.002)
    assert waited.compute_s == pytest.approx(0.008)
    overlapped = Measured(2, 2, 0.010, 0.001, LINK, NBYTES, 0.0, False, allreduce_s=0.002)
    assert overlapped.compute_s == pytest.approx(0.009)


def test_the_epochs_table_is_one_at_one_learner_and_interpolates_in_log_k() -> None:
    for scaling, tables in EPOCHS_VS_BSP.items():
        for label, table in tables.items():
            assert label in CANDIDATES  # keyed by the candidate's label (a rule at one period)
            assert epochs_vs_bsp(label, 1, scaling) == 1.0
            for k, ratio in table.items():
                assert epochs_vs_bsp(label, k, scaling) == ratio
            assert epochs_vs_bsp(label, 64, scaling) == table[max(table)]  # past the table: its largest k
    sma = EPOCHS_VS_BSP["linear"]["SMA"]
    assert epochs_vs_bsp("SMA", 2, "linear") == pytest.approx((sma[1] + sma[4]) / 2)
    assert epochs_vs_bsp("BSP", 12, "linear") == epochs_vs_bsp("BSP", 12) == 1.0


#: The measured run the ``none`` table is read from, and its rows' names → the candidates' labels.
EPOCHS_RUN = "## Epochs to 80%, 85%, 90% against k — 2026-12-03 06:46"
ROWS = {
    "SMA (lr as written)": "SMA",
    "LOCALSGD period 4 (lr as written)": "LOCALSGD (period 4)",
    "LOCALSGD (lr as written)": "LOCALSGD (period 8)",
    "LOCALSGD period 16 (lr as written)": "LOCALSGD (period 16)",
}


def recorded_tables(run: str) -> dict[str, list[list[str]]]:
    """A recorded run's tables: bold title → rows of cells (the header row left out)."""
    tables = {}
    for section in run.split("\n**")[1:]:
        title, _, body = section.partition("**")
        lines = [line for line in body.splitlines() if line.startswith("| ") and "---" not in line]
        tables[title] = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
    return tables


def in_most_seeds(cell: str) -> bool:
    """Whether a cell such as ``8.0 (3/3)`` or ``21.5 (2/3)`` says most seeds reached the target."""
    if "(" not in cell or cell.startswith("missed"):
        return False
    got, of = cell.split("(")[1].rstrip(")").split("/")
    return 2 * int(got) > int(of)


def test_the_rate_as_written_table_is_the_recorded_runs_mean_over_the_targets_every_rule_reached() -> None:
    """EPOCHS_VS_BSP["none"] at k = 2, 4, 8 is what benchmarks/results/epochs_to_target.md recorded: the
    mean of each rule's epochs relative to BSP's over the targets that every rule reached in most seeds
    (80, 85 and 90 % at k = 2 and 4; 80 % at k = 8)."""
    text = (REPO / "benchmarks" / "results" / "epochs_to_target.md").read_text(encoding="utf-8")
    tables = recorded_tables(text.split(EPOCHS_RUN, 1)[1].split("\n## ", 1)[0])
    targets = [title[3:] for title in tables if title.startswith("to ")]
    assert targets == ["80%", "85%", "90%"]
    ks = (2, 4, 8)
    reached = {(t, k): all(in_most_seeds(row[1 + i]) for row in tables[f"to {t}"]) for t in targets
               for i, k in enumerate(ks)}  # fmt: skip
    assert [t for t in targets if reached[(t, 8)]] == ["80%"]
    ratios = {tuple(row[0].rsplit(", ", 1)): row[1:] for row in tables["epochs relative to BSP's"]}
    for name, label in ROWS.items():
        for i, k in enumerate(ks):
            used = [float(ratios[(name, t)][i]) for t in targets if reached[(t, k)]]
            mean = sum(used) / len(used)
            assert EPOCHS_VS_BSP["none"][label][k] == pytest.approx(mean, abs=0.006), (label, k, used)


def test_the_table_is_the_learning_rate_rules() -> None:
    """Every rate scaled with k (linear, sqrt) and the rate as written (none, the default) read their own
    tables: at k = 8 model averaging's extra epochs differ by far between them."""
    assert {"linear", "none"} <= set(EPOCHS_VS_BSP)
    label = "LOCALSGD (period 8)"
    assert epochs_vs_bsp(label, 8, "sqrt") == epochs_vs_bsp(label, 8, "linear")
    assert epochs_vs_bsp(label, 8) == epochs_vs_bsp(label, 8, "none") < epochs_vs_bsp(label, 8, "linear")
    # LOCALSGD measured at 0.6 of BSP's step: its epochs decide, and the line names the table read (as
    # written: LOCALSGD, at period 4 here, priced from period 8's measured step for 1.15x BSP's epochs)
    figures = Measured(2, 8, 0.006, 0.0005, LINK, NBYTES, 0.0, False, allreduce_s=0.001,
                       active="LOCALSGD (period 8)", known=(("BSP", 0.010),))  # fmt: skip
    as_written = choose_rule(figures)
    assert as_written.chosen.rule == "LOCALSGD" and "lr_scaling none" in as_written.line()
    scaled = choose_rule(dataclasses.replace(figures, lr_scaling="linear"))
    assert scaled.chosen.label == "BSP" and "lr_scaling linear" in scaled.line()


def test_the_link_fit_recovers_alpha_and_beta_from_two_ring_allreduces() -> None:
    for ranks in (2, 3, 8):
        short, long = 256, 4_000_000
        fit = fit_link(
            ranks, (short, ring_allreduce(short, ranks, LINK)), (long, ring_allreduce(long, ranks, LINK))
        )
        assert fit.alpha == pytest.approx(LINK.alpha) and fit.beta == pytest.approx(LINK.beta)
    assert fit_link(2, (256, 1e-3), (1_000_000, 5e-4)) == Link(5e-4, 0.0)  # noise: β not below 0
    assert fit_link(1, (256, 1.0), (1_000, 2.0)) == Link(0.0, 0.0)


def test_the_decision_line_names_every_candidate_and_the_figures_behind_it() -> None:
    line = choose_rule(measured(compute=0.005, allreduce=0.020)).line()
    assert line.startswith("chose LOCALSGD (period 8); time to target relative to BSP: LOCALSGD (period 8) ")
    for text in ("SMA ", "BSP 1.00 (25 ms/step measured × 1.00 epochs)", "compute 5 ms/step",
                 "allreduce of 1000 KB", "over 2 rank(s)", "k = 2", "B_noise not measured"):  # fmt: skip
        assert text in line, (text, line)
    assert math.isnan(measured(0.01, 0.01).noise_scale)


def test_auto_refuses_a_candidate_it_does_not_price_and_names_those_it_does() -> None:
    with pytest.raises(
        ConfigError, match=r"^\[rule\] candidates = BSP,EASGD: AUTO chooses among BSP, SMA, LOCALSGD$"
    ):
        RULES.get("AUTO")(candidates="BSP,EASGD")
    rule = RULES.get("auto")(candidates=" sma , localsgd,SMA")
    periods = [f"LOCALSGD (period {h})" for h in (4, 8, 16)]
    assert rule.hyper.candidates == "SMA,LOCALSGD" and list(rule.options) == ["SMA", *periods]
    assert not rule.averages_gradients_throughout  # an uncapped lr scaling is refused, as for SMA itself


def test_a_decision_taken_under_local_sgd_keeps_its_measured_step_and_prices_bsp_by_the_model() -> None:
    """Decided again while LOCALSGD runs: its step is the measured one, its hooks hold one allreduce in 8."""
    running = dataclasses.replace(measured(compute=0.005, allreduce=0.020), active="LOCALSGD (period 8)")
    running = dataclasses.replace(running, step_s=0.0075, hooks_s=0.0025)
    assert running.compute_s == pytest.approx(0.005)
    decision = choose_rule(running)
    steps = {c.label: c.step_s for c in decision.candidates}
    assert steps["LOCALSGD (period 8)"] == 0.0075
    assert steps["BSP"] == pytest.approx(
        0.005 + 0.020
    )  # compute plus the whole allreduce, nothing overlapped
    assert decision.chosen.label == "LOCALSGD (period 8)"


def test_a_move_needs_a_prediction_clearly_sooner_than_the_running_rules_measured_time() -> None:
    """A token-bucket link: measured under LOCALSGD, a lone allreduce went at the burst rate (0.2 ms), so
    the model prices BSP's step at 6.2 ms: 0.94× LOCALSGD's measured time to target, within the model's
    error, so LOCALSGD is kept (a move needs 0.8× or less) and the line says why."""
    first = dataclasses.replace(
        measured(compute=0.005, allreduce=0.0002), active="LOCALSGD (period 8)", step_s=0.006, hooks_s=0.001
    )
    decision = choose_rule(first)
    assert decision.chosen.label == "LOCALSGD (period 8)" and decision.kept == "BSP"
    assert [c.label for c in decision.candidates] == ["LOCALSGD (period 8)", "BSP", "SMA"]
    assert "chose LOCALSGD (period 8) (kept: BSP predicted 0.94x its time, a move needs 0.8x or less)" in (
        decision.line()
    )
    assert choose_rule(first, labels=("BSP", "SMA")).chosen.label == "BSP"  # LOCALSGD not offered: moves


def test_the_kept_out_candidate_goes_on_trial_and_two_measured_steps_need_no_margin() -> None:
    """AUTO puts the candidate the margin kept out on trial for one window (its line says so and why);
    with both steps measured the soonest is chosen, however close (``margin = 1``)."""
    first = dataclasses.replace(
        measured(compute=0.005, allreduce=0.0002), active="LOCALSGD (period 8)", step_s=0.006, hooks_s=0.001
    )
    trial = choose_rule(first).on_trial()
    assert trial.chosen.label == "BSP" and trial.trial == "LOCALSGD (period 8)" and not trial.kept
    assert [c.label for c in trial.candidates] == ["BSP", "LOCALSGD (period 8)", "SMA"]
    assert trial.line().startswith(
        "chose BSP for one window on trial (predicted 0.94x LOCALSGD (period 8)'s time: a move on a price "
        "needs 0.8x or less, so its step is measured first); time to target relative to BSP: BSP 1.00 ("
    )
    both = dataclasses.replace(first, active="BSP", step_s=0.0062, known=(("LOCALSGD (period 8)", 0.006),))
    assert choose_rule(both).chosen.label == "BSP"  # LOCALSGD's time is 1.06x BSP's
    lost = dataclasses.replace(both, step_s=0.0075)  # BSP's measured time: 1.14x LOCALSGD's
    assert choose_rule(lost, margin=1.0).chosen.label == "LOCALSGD (period 8)"
    assert choose_rule(lost).chosen.label == "BSP" and choose_rule(lost).kept == "LOCALSGD (period 8)"


def test_a_step_measured_while_a_candidate_ran_beats_the_models_price() -> None:
    """BSP ran (chosen at a larger k, say) at 17.7 ms a step, the sustained rate. Decided again, LOCALSGD
    keeps the 6 ms it measured while it ran, not the model's price from the slow allreduce, and wins."""
    again = dataclasses.replace(
        measured(compute=0.005, allreduce=0.0127), step_s=0.0177, known=(("LOCALSGD (period 8)", 0.006),)
    )
    decision = choose_rule(again)
    steps = {c.label: c.step_s for c in decision.candidates}
    assert steps == {"BSP": 0.0177, "LOCALSGD (period 8)": 0.006, "SMA": pytest.approx(0.0177)}
    assert decision.chosen.label == "LOCALSGD (period 8)" and not decision.kept
    line = decision.line()
    assert "LOCALSGD (period 8) 0.37 (6 ms/step measured × " in line and "SMA 1.02 (17.7 ms/step × " in line


def test_another_period_of_the_running_rule_is_taken_on_its_price_without_margin_or_trial() -> None:
    """Measured under LOCALSGD at period 8 (6 ms a step, 1 ms of it averaging), period 16 is priced at
    5.5 ms: 0.92x period 8's time to target, inside the margin a move to another rule needs, but the same
    measured compute and average at another period: taken at once, nothing kept out, nothing on trial."""
    first = dataclasses.replace(
        measured(compute=0.005, allreduce=0.008),
        active="LOCALSGD (period 8)",
        step_s=0.006,
        hooks_s=0.001,
        lr_scaling="none",
    )
    decision = choose_rule(first, labels=("LOCALSGD (period 8)", "LOCALSGD (period 16)"))
    steps = {c.label: c.step_s for c in decision.candidates}
    assert steps["LOCALSGD (period 16)"] == pytest.approx(0.0055)
    ratio = decision.candidates[0].time / next(c.time for c in decision.candidates if c.label.endswith("8)"))
    assert MARGIN < ratio < 1
    assert decision.chosen.label == "LOCALSGD (period 16)" and not decision.kept and not decision.trial
