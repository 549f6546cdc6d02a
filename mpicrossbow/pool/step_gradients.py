"""StepGradients: what one training step leaves in a pool's gradient rows, and the one place it is arranged.

**The contract.** After a pool's ``compute()``, every learner's gradient row holds the gradient of that
learner's loss on this step's batch, multiplied by the loss scale (fp16's, :mod:`.loss_scale`; 1 otherwise)
and holding nothing of an earlier step. Every engine (the serial :class:`~.learner.Learner`, the fused pool)
and the fused engine's step by hand (:mod:`.chain_step`) reach it through a :class:`StepGradients`:

* :meth:`StepGradients.start` begins a step: the rows are zeroed, save what the step's nodes *write* rather
  than add: every gradient (a step by hand), or the columns of the chains under autograd (LeNet-28's head,
  97 % of a row, neither zeroed nor read back: fused ÷ bound +0–5 %, m = 8, b = 4, one thread);
* the loss scale enters once, as the seed of the backward: :meth:`StepGradients.backward` multiplies the loss
  before autograd's backward, a step by hand starts its loss gradient at :attr:`StepGradients.scale`;
* accumulation enters once: :attr:`StepGradients.adds` says whether a gradient put into a row is added to it
  (the rows were zeroed, as autograd's ``AccumulateGrad`` does) or overwrites it (a written step);
  :func:`put_product` and :func:`put_sum` are the two ways a fused node puts a gradient there.

**Writing straight into the rows.** Autograd hands every parameter's gradient to an ``AccumulateGrad`` node,
which adds it into ``.grad``: for the fused pool's ``.grad`` views of the rows that is a read of the new
gradient, a read and a write of the row — for LeNet-28's 784×120 layer of 8 replicas, 9 MB moved per step
after the 3 MB batched matmul that made it. A node that knows its parameters' rows (a chain of Linear
layers, :mod:`.batched_chain`) adds its product into the row in the matmul itself instead (``baddbmm_``)
and returns no gradient for those parameters. Measured on LeNet-28's classifier head alone (m = 8, batch 4,
one thread): forward and backward 548 µs through ``AccumulateGrad``, 315 µs writing the rows. Only while
the pool's own backward runs (:meth:`StepGradients.backward`): a ``torch.autograd.grad`` call, or a backward
of the fused network outside the pool, returns gradients as usual and leaves ``.grad`` alone.

**Watchers.** No autograd hook fires for a parameter written this way: the step tells the pool's gradient
watchers itself (:meth:`StepGradients.written`), as soon as each parameter's gradient is complete — the
moment a rule overlapping its exchange with the backward (BSP's buckets) needs, and earlier than a hook,
which would fire only once the whole node is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import ContractError
from .precision import FP32, Precision


class StepGradients:
    """One pool's gradient rows under the step's contract (see the module docstring).

    ``rows``: the tensor holding every gradient the step fills (zeroed at a step's start); ``precision``:
    the pool's, whose loss scale seeds the backward; ``index`` maps ``id()`` of each parameter a node writes
    to its position (the ``i`` of a watcher's ``ready(i, m)``), ``m`` the replicas every write covers.
    """

    def __init__(
        self, rows: torch.Tensor, precision: Precision = FP32, index: dict[int, int] | None = None, m: int = 1
    ) -> None:
        self.rows, self.precision = rows, precision
        self.index, self.m = index or {}, m
        #: Whether a node may put gradients into ``.grad`` now (the pool's own backward is running).
        self.active = False
        #: Whether a gradient put into a row adds to it (False: the step writes, overwriting).
        self.adds = True
        #: ``ready(i, m)`` callbacks of the pool's gradient watchers.
        self.watchers: list[Callable[[int, int], None]] = []

    def start(self, written: bool = False, blocks: Sequence[torch.Tensor] | None = None) -> None:
        """A step begins: zero the rows, unless its backward ``written`` every gradient (a step by hand); with
        ``blocks`` (the rows' blocks autograd adds into), only those, the nodes writing every other column."""
        self.adds = not written and blocks is None
        for block in [] if written else [self.rows] if blocks is None else blocks:
            block.zero_()

    @property
    def scale(self) -> float:
        """The seed of this step's backward: the loss scale (1 unless fp16)."""
        return self.precision.scale

    def backward(self, loss: torch.Tensor) -> None:
        """Autograd's backward of ``loss`` seeded with :attr:`scale`, nodes allowed to put gradients into the
        rows meanwhile (:attr:`active`)."""
        scale = self.scale
        self.active = True
        try:
            (loss * scale if scale != 1.0 else loss).backward()
        finally:
            self.active = False

    def rows_of(self, weights: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None] | None:
        """Each weight's ``.grad`` for a node to put its gradient into while :meth:`open`, else None (the node
        hands its gradients to autograd)."""
        return grad_rows(weights) if self.active else None

    def written(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete in its row: tell every watcher."""
        if self.watchers:
            i = self.index[id(param)]
            for ready in self.watchers:
                ready(i, self.m)

    def announcer(self, weights: Sequence[torch.Tensor | None]) -> Callable[[int], None] | None:
        """``ready(k)`` telling the watchers that ``weights[k]``'s gradient is complete; None without any."""
        if not self.watchers:
            return None
        return lambda k: self.written(weights[k])  # type: ignore[arg-type]


def grad_rows(weights: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each weight's ``.grad`` — its view of the pool's gradient rows — for a node to put gradients into; an
    error naming the problem if a weight has none (the rows were not pointed at it)."""
    into = [None if w is None else w.grad for w in weights]
    if any(g is None for g, w in zip(into, weights, strict=True) if w is not None):
        raise ContractError("a fused chain writes into its weights' .grad rows, and one has none")
    return into


def put_product(row: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """``a @ b`` (batched) into ``row``: added in the matmul itself, or written by it. A row of another dtype
    (the fp32 master rows under mixed precision) receives the 16-bit product cast."""
    if row.dtype != a.dtype:
        product = torch.bmm(a, b)
        row.add_(product) if add else row.copy_(product)
    elif add:
        row.baddbmm_(a, b)
    else:
        torch.bmm(a, b, out=row)


def put_sum(row: torch.Tensor, grad: torch.Tensor, add: bool) -> None:
    """``grad`` summed over its samples (dimension 1, a bias's gradient) into ``row``, added or written; a row
    of another dtype receives the sum computed in its own dtype."""
    if row.dtype != grad.dtype:
        total = grad.sum(1, dtype=row.dtype)
        row.add_(total) if add else row.copy_(total)
    elif add:
        row.add_(grad.sum(1))
    else:
        torch.sum(grad, 1, out=row)
