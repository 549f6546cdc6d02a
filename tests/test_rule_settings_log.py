"""SMA, GOSGD and synchronous EASGD log their settings once, at the start, as BSP and asynchronous EASGD do.

Each rule runs its whole life (bind, steps, finish) on two in-process ranks with its module logger captured
(propagation aside: the ``mpicrossbow`` logger of a process that ran ``setup_logging`` does not propagate);
each rank must log exactly one line with the values it runs with, whatever the number of steps. The rank in
front of every line is the job's handler's (:func:`mpicrossbow.log.setup_logging`), not the rule's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest

from conftest import run_world
from mpicrossbow.rules import EASGD, GOSGD, SMA, Rule

RANKS, STEPS = 2, 3


class Lines(logging.Handler):
    """Keeps the formatted messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logged() -> Iterator[Callable[[str], list[str]]]:
    """``logged(module)``: the INFO and higher messages of ``mpicrossbow.rules.<module>`` in this test."""
    handlers: dict[str, Lines] = {}
    levels: dict[str, int] = {}
    for module in ("sma", "gosgd", "easgd"):
        logger = logging.getLogger(f"mpicrossbow.rules.{module}")
        levels[module] = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(handlers.setdefault(module, Lines()))
    yield lambda module: handlers[module].lines
    for module, handler in handlers.items():
        logger = logging.getLogger(f"mpicrossbow.rules.{module}")
        logger.removeHandler(handler)
        logger.setLevel(levels[module])


@pytest.mark.parametrize(
    ("make", "module", "line"),
    [
        (
            lambda: SMA(),
            "sma",
            "SMA: α = 0.2 (default), z's momentum μ = 0.9 over k = 2 learner(s) (stability bound 0.9744)",
        ),
        (
            lambda: SMA(alpha=0.3, momentum=0.5),
            "sma",
            "SMA: α = 0.3, z's momentum μ = 0.5 over k = 2 learner(s) (stability bound 0.8571)",
        ),
        (
            lambda: GOSGD(p=0.5, seed=3),
            "gosgd",
            "GOSGD: 2 learner(s), gossip probability p = 0.5 per step, peers drawn with seed (3, rank)",
        ),
        (
            lambda: EASGD(tau=2),
            "easgd",
            "EASGD sync: 2 learner(s), α = 0.45, τ = 2, local step: the optimizer's own",
        ),
        (
            lambda: EASGD(tau=4, alpha=0.1, momentum=0.5),
            "easgd",
            "EASGD sync: 2 learner(s), α = 0.1, τ = 4, local step: EAMSGD's Nesterov momentum δ = 0.5",
        ),
    ],
    ids=["SMA", "SMA-alpha-momentum", "GOSGD", "EASGD-sync", "EASGD-sync-eamsgd"],
)
def test_the_rule_logs_its_settings_once_per_rank_at_the_start(
    logged: Callable[[str], list[str]], make: Callable[[], Rule], module: str, line: str
) -> None:
    run_world(RANKS, make, STEPS)
    assert logged(module) == [line] * RANKS
