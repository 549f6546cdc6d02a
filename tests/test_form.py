"""The fused engine's choice of form (mpicrossbow.pool.form): the trial's schedule and its decision."""

from __future__ import annotations

import pytest

from mpicrossbow.pool.form import FUSED, UNFUSED, FormChoice


def run_trial(choice: FormChoice, seconds: dict[str, list[float]]) -> list[str]:
    """Drive ``choice`` with scripted step times per form; the forms it asked for, in order."""
    asked, left = [], {form: list(times) for form, times in seconds.items()}
    while choice.chosen is None:
        form = choice.form()
        asked.append(form)
        choice.record(left[form].pop(0) if choice.timing else None)
    return asked


def test_always_and_never_choose_without_a_trial() -> None:
    assert FormChoice("always").chosen == FUSED and FormChoice("always").steps_to_decide == 0
    assert FormChoice("never").form() == UNFUSED


def test_the_trial_warms_up_then_alternates_and_keeps_the_faster_form() -> None:
    choice = FormChoice("auto", rounds=3)
    assert choice.steps_to_decide == 8
    # Fused's best step (0.1) beats unfused's (0.2); one step slowed by other load does not count.
    asked = run_trial(choice, {FUSED: [0.1, 0.1, 0.9], UNFUSED: [0.2, 0.2, 0.2]})
    assert asked == [FUSED, UNFUSED, FUSED, UNFUSED, UNFUSED, FUSED, FUSED, UNFUSED]
    assert choice.chosen == FUSED and choice.form() == FUSED and not choice.timing
    assert choice.times == {FUSED: [0.1, 0.1, 0.9], UNFUSED: [0.2, 0.2, 0.2]}


def test_the_unfused_form_wins_when_fusing_does_not_pay() -> None:
    choice = FormChoice("auto", rounds=2)
    run_trial(choice, {FUSED: [0.5, 0.4], UNFUSED: [0.3, 0.35]})
    assert choice.chosen == UNFUSED


def test_a_resumed_trial_continues_where_it_stood() -> None:
    first = FormChoice("auto")
    for _ in range(3):
        first.record(0.1 if first.timing else None)
    second = FormChoice("auto")
    second.load_state_dict(first.state_dict())
    assert second.form() == first.form() and second.steps_to_decide == first.steps_to_decide == 7
    fixed = FormChoice("never")
    fixed.load_state_dict(first.state_dict())
    assert fixed.chosen == UNFUSED


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="fuse must be auto, always or never, got 'sometimes'"):
        FormChoice("sometimes")
