"""Gradient buckets: BSP's allreduce split into slices that start during backward, as DDP's reducer does.

**Layout.** A bucket is a contiguous slice ``[start, end)`` of a learner's flat gradient (the pool's
``grad_layout()``: every parameter's offset and size, in flat order) holding whole parameters. Buckets are
cut walking the parameters from last to first — the order backward produces them (measured on LeNet,
ResNet-20 and VGG-16 with autograd hooks: reverse parameter order, up to the order of one layer's weight and
bias) — and a bucket is closed before it would exceed ``bucket_bytes``; a parameter larger than that gets a
bucket of its own. So one bucket for everything is ``bucket_bytes`` ≥ the model, and bucket k of every rank
covers the same slice. DDP rebuilds its buckets after the first step from the observed order; with the order
above that changes no bucket boundary by more than one bias, so it is not done.

**When a bucket starts.** The pool calls :meth:`GradBuckets.ready` from autograd's post-accumulate hooks
(``watch_gradients``) each time a parameter's gradient is complete for n learners (1 per call in the serial
engine, all m at once in the fused one). Once every learner of the rank has produced every gradient of a
bucket, the learners' slices are summed in learner order into the bucket's slice of a separate communication
buffer (``total = g_0 + g_1 + …``, the same additions as :meth:`Rule.average`), and its
``comm.allreduce(slice, async_op=True)`` starts while backward goes on. Buckets start strictly in bucket
order on every rank (a bucket that is ready early waits for the ones before it), so the collectives match
across ranks even when the ranks' backward passes order parameters differently, as DDP's reducer does.

**Progress.** MPICH moves a non-blocking collective only while the process is inside an MPI call, so each
hook also calls ``test()`` on the oldest unfinished handle, and the allreduces advance in the gaps between
gradients instead of all at the final ``wait()``. Measured on VGG-16, 2 ranks, 5 MiB buckets (a loaded
2-core machine): the wait after backward was 0.10 s per step with these tests and 0.21 s without them (the
one allreduce after backward: 3.9 s, MPICH's blocking shared-memory allreduce suffering from the load).
MPICH's own progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1``) is not used: it polls on a core of its own,
which 2 ranks on 2 cores do not have. Other communicators progress on their own threads (Gloo, NCCL) or
complete at once (the in-process world, a shared-memory allreduce); only the :class:`Communicator`
interface is used, so any of them works.

**Finishing a step** (:meth:`GradBuckets.finish_step`, from BSP's ``on_gradients``): the last bucket in
order starts there, not in a hook, carrying a flag: a NaN written into its first element when one of this
rank's learners had a non-finite loss (``[session] on_nan = skip`` zeroes such a learner's gradient after
backward, when the other buckets have left). Every handle is waited for and the sum divided by k into every
learner's gradient: the additions and the division of the one-allreduce path, so float32 results are
bitwise equal wherever the communicator sums a slice in the same order as the whole buffer (in-process
always, 2 ranks always, MPICH at 4 ranks in the tests). If the flag came back non-finite — on every rank
alike, since all hold the same sum — the step is redone by the one-allreduce path on the learners' own
(zeroed) gradients, which the separate communication buffer left intact.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..comm.base import Communicator, Handle
from ..pool.flat import empty_flat
from ..trace import complete

log = logging.getLogger(__name__)


@dataclass
class Bucket:
    """One contiguous slice ``[start, end)`` of the flat gradient and the parameters (indices) it holds."""

    start: int
    end: int
    params: list[int]
    #: Learner-gradients still to come this step: len(params) × learners when the step starts.
    pending: int = 0
    handle: Handle | None = field(default=None, repr=False)
    #: When its allreduce started (``perf_counter``), for the timeline.
    started: float = 0.0


def plan_buckets(layout: Sequence[tuple[int, int]], bucket_elems: int) -> list[Bucket]:
    """Cut the parameters ``layout`` ((offset, numel) in flat order, tiling ``[0, P)``) into buckets, last
    parameter first, each at most ``bucket_elems`` elements unless one parameter alone is larger."""
    buckets: list[Bucket] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(layout))):
        numel = layout[i][1]
        if current and size + numel > bucket_elems:
            buckets.append(_bucket(layout, current))
            current, size = [], 0
        current.append(i)
        size += numel
    if current:
        buckets.append(_bucket(layout, current))
    return buckets


def _bucket(layout: Sequence[tuple[int, int]], params: list[int]) -> Bucket:
    first, last = min(params), max(params)
    return Bucket(layout[first][0], layout[last][0] + layout[last][1], sorted(params))


def contiguous(layout: Sequence[tuple[int, int]], total: int) -> bool:
    """Whether the (offset, numel) pairs tile ``[0, total)`` one after another."""
    offset = 0
    for start, numel in layout:
        if start != offset:
            return False
        offset += numel
    return offset == total


class GradBuckets:
    """The bucketed, overlapped gradient mean of one rank's learners (see the module docstring)."""

    def __init__(
        self,
        comm: Communicator,
        grads: Sequence[torch.Tensor],
        layout: Sequence[tuple[int, int]],
        bucket_bytes: int,
        nonfinite: Callable[[], list[int]],
        fallback: Callable[[], None],
    ) -> None:
        """``grads``: every learner's flat gradient; ``nonfinite()``: this rank's learners whose loss was
        not finite; ``fallback()``: the one-allreduce mean, to redo a step when a rank had such a learner."""
        self.comm, self.grads = comm, list(grads)
        self.nonfinite, self.fallback = nonfinite, fallback
        first = self.grads[0]
        elems = max(1, bucket_bytes // first.element_size())
        self.buckets = plan_buckets(layout, elems)
        self.bucket_of = [0] * len(layout)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.params:
                self.bucket_of[i] = b
        self.total = empty_flat(first.numel(), first.device, first.dtype)
        self._next = 0  # the next bucket to start, in order
        self._oldest = 0  # the oldest started bucket that may still be in flight
        self._arm()
        log.info(
            "BSP overlap: %d bucket(s) of ≤ %.2f MiB over %d parameter tensor(s), %d learner(s)",
            len(self.buckets),
            bucket_bytes / 2**20,
            len(layout),
            len(self.grads),
        )

    def _arm(self) -> None:
        """Expect every parameter's gradient from every learner again (a new step)."""
        m = len(self.grads)
        for bucket in self.buckets:
            bucket.pending = len(bucket.params) * m
            bucket.handle = None
        self._next = self._oldest = 0

    def ready(self, index: int, learners: int) -> None:
        """Autograd finished parameter ``index``'s gradient for ``learners`` learners (a pool hook)."""
        bucket = self.buckets[self.bucket_of[index]]
        bucket.pending -= learners
        if bucket.pending < 0:
            raise RuntimeError(
                "BSP overlap: a gradient arrived twice in one step (backward ran again before the rule's "
                "on_gradients); set [rule] bucket_mb = 0 for models that call backward more than once"
            )
        # Start every bucket that is complete, in order; the last one waits for finish_step (its flag).
        while self._next < len(self.buckets) - 1 and self.buckets[self._next].pending == 0:
            self._start(self._next)
            self._next += 1
        self._progress()

    def _start(self, b: int, flag: bool = False) -> None:
        """Sum the learners' slices of bucket ``b`` into the buffer and start its allreduce; ``flag``
        writes a NaN into the bucket's first element before it leaves."""
        bucket = self.buckets[b]
        lo, hi = bucket.start, bucket.end
        out = self.total[lo:hi]
        if len(self.grads) == 1:
            out.copy_(self.grads[0][lo:hi])
        else:
            torch.add(self.grads[0][lo:hi], self.grads[1][lo:hi], out=out)
            for other in self.grads[2:]:
                out.add_(other[lo:hi])
        if flag:
            out[0] = math.nan
        bucket.started = time.perf_counter()
        bucket.handle = self.comm.allreduce(out, async_op=True)

    def _progress(self) -> None:
        """Let the communicator advance: test handles oldest first, up to the first unfinished one."""
        while self._oldest < self._next:
            handle = self.buckets[self._oldest].handle
            if handle is not None and not handle.test():
                return
            self._oldest += 1

    def finish_step(self) -> None:
        """Start what is left (the last bucket with the non-finite flag), wait, and set every learner's
        gradient to the mean over all k learners; redo the step without overlap if any loss was not finite."""
        last = len(self.buckets) - 1
        while self._next < last:  # parameters that got no gradient this step (unused in forward)
            self._start(self._next)
            self._next += 1
        self._start(last, flag=bool(self.nonfinite()))
        flag = self.buckets[last].start
        for b, bucket in enumerate(self.buckets):
            assert bucket.handle is not None
            bucket.handle.wait()
            complete(f"bucket {b}", "bucket", bucket.started, time.perf_counter(), track="buckets")
        self._arm()
        if not math.isfinite(float(self.total[flag])):
            log.info("BSP overlap: a loss was not finite; this step's mean is taken again without it")
            self.fallback()
            return
        k = self.comm.size * len(self.grads)
        torch.div(self.total, k, out=self.grads[0])
        for other in self.grads[1:]:
            other.copy_(self.grads[0])
