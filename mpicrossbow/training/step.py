"""``train_step``: the one place the step sequence is written.

Every learner computes its gradients on its next batch, the rule sees them (``on_gradients``: BSP's
allreduce), every learner applies its optimizer step, the rule exchanges (``exchange``: model averaging,
elastic pulls, gossip, pushes to a server). The training loop, the tests and the benchmarks all call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..pool.base import LearnerPool
from ..rules.base import Rule
from ..trace import complete, span


def train_step(
    pool: LearnerPool,
    rule: Rule,
    step: int,
    count: int | None = None,
    guard: Callable[[int], None] | None = None,
) -> float:
    """Run step ``step`` (counted over the whole run) on batch ``count`` of the epoch; return the seconds the
    rule's hooks took (the exchange time).

    ``count`` defaults to ``step`` modulo the steps per epoch. ``guard(step)`` runs between backward and
    the rule's first hook: the loop checks the loss there (NaN policy, fault injection, watchdog phase).
    """
    with span("forward+backward", "compute", step=step):
        pool.compute(step % pool.n_batch_train if count is None else count)
    if guard is not None:
        guard(step)
    before = time.perf_counter()
    rule.on_gradients(step)
    between = time.perf_counter()
    complete("on_gradients", "exchange", before, between)
    with span("optimizer step", "compute"):
        pool.apply()
    after = time.perf_counter()
    rule.exchange(step)
    end = time.perf_counter()
    complete("exchange", "exchange", after, end)
    return (between - before) + (end - after)
