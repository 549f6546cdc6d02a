"""Gradients written straight into the fused pool's rows during its own training step, bypassing autograd's
accumulation.

Autograd hands every parameter's gradient to an ``AccumulateGrad`` node, which adds it into ``.grad``: for
the fused pool's ``.grad`` views of the gradient rows that is a read of the new gradient, a read and a write
of the row — for LeNet-28's 784×120 layer of 8 replicas, 9 MB moved per step after the 3 MB batched matmul
that made it. A node that knows its parameters' gradient rows (a chain of Linear layers,
:mod:`.batched_chain`) can add its product into the row in the matmul itself instead (``baddbmm_``) and
return no gradient for those parameters. Measured on LeNet-28's classifier head alone (m = 8, batch 4, one
thread): forward and backward 548 µs through ``AccumulateGrad``, 315 µs writing the rows.

Only while the pool's own step runs (:meth:`GradSink.open`): a ``torch.autograd.grad`` call, or a backward
of the fused network outside the pool, returns gradients as usual and leaves ``.grad`` alone. No autograd
hook is registered for a parameter written this way: the sink tells the pool's gradient watchers itself,
as soon as each parameter's gradient is complete — the moment a rule overlapping its exchange with the
backward (BSP's buckets) needs, and earlier than a hook, which would fire only once the whole node is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class GradSink:
    """Where fused nodes write their parameters' gradients, and who is told when one is complete.

    ``index`` maps ``id()`` of each fused parameter to its position in the pool's ``fused_params`` (the
    ``i`` of a watcher's ``ready(i, m)``); ``m`` is the number of replicas every write covers.
    """

    def __init__(self, index: dict[int, int], m: int) -> None:
        self.index, self.m = index, m
        #: Whether a node may write into ``.grad`` now (the pool's own step is running).
        self.active = False
        #: ``ready(i, m)`` callbacks of the pool's gradient watchers.
        self.watchers: list[Callable[[int, int], None]] = []

    @contextmanager
    def open(self) -> Iterator[None]:
        """Let nodes write into ``.grad`` for the duration of the block (the pool's step)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def written(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete in its row: tell every watcher."""
        if self.watchers:
            i = self.index[id(param)]
            for ready in self.watchers:
                ready(i, self.m)
