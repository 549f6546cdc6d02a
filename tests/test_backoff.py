"""The shared-memory wait's backoff: a short wait only yields, a long one naps, and no nap delays a wait's end
by more than 5 % of its length or a millisecond (mpicrossbow/comm/backoff.py)."""

from __future__ import annotations

import pytest

from mpicrossbow.comm import backoff
from mpicrossbow.comm.backoff import MAX_NAP_S, NAP_SHARE, YIELD_S, Backoff


class Clock:
    """A fake monotonic clock that records what the backoff did: ``("yield",)`` or ``("nap", seconds)``."""

    def __init__(self) -> None:
        self.now = 100.0
        self.done: list[tuple[str, float]] = []

    def sched_yield(self) -> None:
        self.done.append(("yield", 0.0))

    def sleep(self, seconds: float) -> None:
        self.done.append(("nap", seconds))
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(backoff.time, "monotonic", lambda: fake.now)
    monkeypatch.setattr(backoff.time, "sleep", fake.sleep)
    monkeypatch.setattr(backoff.os, "sched_yield", fake.sched_yield)
    return fake


def test_a_wait_yields_until_it_is_old_then_naps_a_bounded_share_of_it(clock: Clock) -> None:
    wait = Backoff()
    napped = []
    for _ in range(5):  # 5 polls within the first YIELD_S
        napped.append(wait.pause())
        clock.now += YIELD_S / 10
    assert [kind for kind, _ in clock.done] == ["yield"] * 5
    clock.now += YIELD_S  # the wait is now 1.5 x YIELD_S old
    napped.append(wait.pause())
    assert napped == [False] * 5 + [True]  # the caller learns which pauses napped
    kind, nap = clock.done[-1]
    assert kind == "nap" and nap == pytest.approx(NAP_SHARE * 1.5 * YIELD_S)
    clock.now += 10.0  # a straggler: ten seconds
    wait.pause()
    assert clock.done[-1] == ("nap", MAX_NAP_S)


def test_every_nap_is_at_most_a_twentieth_of_the_wait_so_far_and_a_millisecond(clock: Clock) -> None:
    wait, started, ages = Backoff(), clock.now, []
    for _ in range(2000):
        ages.append(clock.now - started)  # how old the wait is when this pause starts
        wait.pause()
        clock.now += 1e-5  # the poll itself
    naps = [(seconds, age) for (kind, seconds), age in zip(clock.done, ages, strict=True) if kind == "nap"]
    # the first YIELD_S (200 polls of 10 us) yield, every later pause naps
    assert len(naps) == 2000 - round(YIELD_S / 1e-5), "a wait of tens of milliseconds went on yielding"
    assert all(seconds <= min(MAX_NAP_S, NAP_SHARE * age) + 1e-12 for seconds, age in naps)
    assert clock.now - started > 0.5  # 2000 polls that nap span half a second, not 20 ms of yielding


def test_a_reset_wait_starts_by_yielding_again(clock: Clock) -> None:
    wait = Backoff()
    wait.pause()
    clock.now += 1.0
    wait.pause()
    assert clock.done[-1][0] == "nap"
    wait.reset()
    wait.pause()
    assert clock.done[-1] == ("yield", 0.0)
