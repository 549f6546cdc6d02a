"""``train_step``: the one place the step sequence is written.

Every learner computes its gradients on its next batch (under the pool's precision: autocast, and fp16's loss
scale), the loop's guard checks the loss, fp16's scaled gradients are divided back and the ranks agree whether
any overflowed (:meth:`~mpicrossbow.pool.loss_scale.LossScale.unscale`: one allreduce of a flag, so no rank
steps alone), the rule sees the gradients (``on_gradients``: BSP's allreduce), every learner applies its
optimizer step, the rule exchanges (``exchange``: model averaging, elastic pulls, gossip, pushes to a server).
The gradient noise scale's probe (:mod:`.noise_scale`), when given, reads the learners' own gradients after
the unscale and the rule's mean after ``on_gradients``. A step whose gradients overflowed on some rank is
skipped on every rank: neither rule hook nor the optimizer runs, so every collective the rule would have
entered is skipped everywhere alike. The training loop, the tests and the benchmarks all call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..pool.base import LearnerPool
from ..rules.base import Rule
from ..trace import complete, span
from .noise_scale import NoiseScale


def train_step(
    pool: LearnerPool,
    rule: Rule,
    step: int,
    count: int | None = None,
    guard: Callable[[int], None] | None = None,
    probe: NoiseScale | None = None,
) -> float:
    """Run step ``step`` (counted over the whole run) on batch ``count`` of the epoch; return the seconds the
    rule's hooks took (the exchange time).

    ``count`` defaults to ``step`` modulo the steps per epoch. ``guard(step)`` runs between backward and
    the rule's first hook: the loop checks the loss there (NaN policy, fault injection, watchdog phase).
    ``probe`` measures the gradient noise scale around ``on_gradients`` on the steps it is due.
    """
    with span("forward+backward", "compute", step=step):
        pool.compute(step % pool.n_batch_train if count is None else count)
    if guard is not None:
        guard(step)
    if not unscaled(pool, rule):
        return 0.0
    if probe is not None:
        probe.before(step, pool, rule)
    before = time.perf_counter()
    rule.on_gradients(step)
    between = time.perf_counter()
    if probe is not None:
        probe.after(step, pool, rule)
    complete("on_gradients", "exchange", before, between)
    with span("optimizer step", "compute"):
        pool.apply()
    after = time.perf_counter()
    rule.exchange(step)
    end = time.perf_counter()
    complete("exchange", "exchange", after, end)
    return (between - before) + (end - after)


def unscaled(pool: LearnerPool, rule: Rule) -> bool:
    """fp16: divide the loss scale out of every learner's gradient and agree across the rule's ranks (a
    synchronous rule's; an asynchronous rank decides alone) whether any overflowed; True when the step goes
    on. Without a loss scale: True at once."""
    scale = pool.precision.loss_scale
    if scale is None:
        return True
    with span("unscale", "compute"):
        return scale.unscale(
            [learner.grads for learner in pool.learners], rule.comm if rule.synchronous else None
        )
