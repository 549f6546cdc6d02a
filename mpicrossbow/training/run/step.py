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

The embedded API (:class:`~mpicrossbow.embed.step_hooks.StepHooks`) runs the same sequence around the user's
own ``optimizer.step()``: the user's loop computes and applies, and the hooks call this module's
:func:`rule_gradients` (probe, ``on_gradients``, probe) before it, :func:`rule_exchange` after it and
:func:`overflow_anywhere` from the fp16 scaler — so the rule's side of a step is written once, here
(tests/test_structure.py fails a second copy).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from ...comm.base import ReduceOp
from ...pool.base import LearnerPool
from ...pool.replica_view import ReplicaView
from ...rules.base import Rule
from ...trace import complete, span
from ..tuning.noise_scale import NoiseScale
from .window import StepWindow

#: Each rank's copies of its learners' gradients for a redo (:func:`kept_gradients`), reused every step.
_KEPT: weakref.WeakKeyDictionary[ReplicaView, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def train_step(
    pool: LearnerPool,
    rule: Rule,
    step: int,
    count: int | None = None,
    guard: Callable[[int], None] | None = None,
    probe: NoiseScale | None = None,
    window: StepWindow | None = None,
) -> float:
    """Run step ``step`` (counted over the whole run) on batch ``count`` of the epoch; return the seconds the
    rule's hooks took (the exchange time).

    ``count`` defaults to ``step`` modulo the steps per epoch. ``guard(step)`` runs between backward and
    the rule's first hook: the loop checks the loss there (NaN policy, fault injection, watchdog phase).
    ``probe`` measures the gradient noise scale around ``on_gradients`` on the steps it is due. ``window``:
    the run's, when it redoes a gradient exchange that met a lost rank (:meth:`StepWindow.redoes`, elastic
    BSP): ``on_gradients`` runs in its guard with the learners' own gradients kept to put back, and a step
    whose exchange the survivors could not redo applies nothing.
    """
    with span("forward+backward", "compute", step=step):
        pool.compute(step % pool.n_batch_train if count is None else count)
    if guard is not None:
        guard(step)
    if not unscaled(pool, rule):
        return 0.0
    if window is not None and window.redoes():
        redo = kept_gradients(pool)
        redone = window.guard(lambda: rule_gradients(rule, step, pool, probe), f"step {step}", redo)
        if redone is None or not window.trains():
            return 0.0
        seconds = redone
    else:
        seconds = rule_gradients(rule, step, pool, probe)
    with span("optimizer step", "compute"):
        pool.apply()
    return seconds + rule_exchange(rule, step)


def kept_gradients(replicas: ReplicaView) -> Callable[[], None]:
    """A copy of each learner's own flat gradient, taken before the exchange (into the same buffers every
    step), and what puts them back: a step whose exchange met a lost rank runs it again over the survivors
    from there (elastic training's redo, :meth:`StepWindow.redoes`)."""
    grads = [learner.grads for learner in replicas.learners]
    kept = _KEPT.get(replicas)
    if kept is None or [k.shape for k in kept] != [g.shape for g in grads]:
        kept = _KEPT[replicas] = [torch.empty_like(g) for g in grads]
    for copy, grad in zip(kept, grads, strict=True):
        copy.copy_(grad)

    def put_back() -> None:
        for copy, grad in zip(kept, grads, strict=True):
            grad.copy_(copy)

    return put_back


def rule_gradients(rule: Rule, step: int, replicas: ReplicaView, probe: NoiseScale | None = None) -> float:
    """The rule's side of a step between backward and the optimizer: the noise probe reads the learners' own
    gradients, ``on_gradients`` (BSP's allreduce), the probe reads the rule's mean; the hook's seconds."""
    if probe is not None:
        probe.before(step, replicas, rule)
    before = time.perf_counter()
    rule.on_gradients(step)
    between = time.perf_counter()
    if probe is not None:
        probe.after(step, replicas, rule)
    complete("on_gradients", "exchange", before, between)
    return between - before


def rule_exchange(rule: Rule, step: int) -> float:
    """The rule's side of a step after the optimizer: ``exchange`` (model averaging, elastic pulls, gossip,
    pushes to a server); its seconds."""
    after = time.perf_counter()
    rule.exchange(step)
    end = time.perf_counter()
    complete("exchange", "exchange", after, end)
    return end - after


def overflow_anywhere(found: bool, rule: Rule) -> bool:
    """Whether any rank's fp16 gradients overflowed this step, given this rank's ``found``: one allreduce
    (MAX) of the flag among a synchronous rule's ranks, so every rank skips the step together; an
    asynchronous rank decides alone."""
    if rule.comm is None or not rule.synchronous:
        return found
    return bool(rule.comm.exact.allreduce_scalars([float(found)], op=ReduceOp.MAX)[0])


def unscaled(pool: LearnerPool, rule: Rule) -> bool:
    """fp16: divide the loss scale out of every learner's gradient and agree across the rule's ranks (a
    synchronous rule's; an asynchronous rank decides alone) whether any overflowed; True when the step goes
    on. Without a loss scale: True at once."""
    scale = pool.precision.loss_scale
    if scale is None:
        return True
    with span("unscale", "compute"):
        return scale.unscale(
            [learner.grads for learner in pool.learners], lambda found: overflow_anywhere(found, rule)
        )
