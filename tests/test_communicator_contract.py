"""The Communicator contract (mpicrossbow/comm/base.py), written once and bound to every implementation.

Each ``check_*`` function below states one part of the contract for a :class:`Subject`: a communicator plus
the few things its implementation declares where the contract leaves a choice (whether 16-bit sums
accumulate in float32, whether a non-contiguous tensor may be accepted, whether a rank can send to itself,
whether messages carry tags). The functions never ask which implementation they run on. Two bindings run
them, in the manner of mpi4py's test mixins (one class of tests, subclasses that only say how to get the
communicator):

* **in process**, as pytest tests: :class:`~mpicrossbow.testing.InProcessWorld` at 1, 2, 3 and 4 ranks, bare
  and wrapped in :class:`~mpicrossbow.comm.CompressedCommunicator` (bf16 and fp16) and in the plain
  :class:`~mpicrossbow.comm.forwarding.ForwardingCommunicator` the wrappers build on; and replica groups'
  :class:`~mpicrossbow.comm.linked.LinkedCommunicator`, two groups of in-process ranks whose first ranks are
  linked over Gloo (it carries no point-to-point messages and no splits: it must refuse them at once);
* **under mpiexec**: this file is also the script every rank runs (``python
  tests/test_communicator_contract.py [IMPL ...] [--also MODULE ...] [--cuda]``); it runs the same functions
  on MPICommunicator, SharedMemoryCommunicator, TorchDistCommunicator (Gloo) and the compressed wrapper over
  MPI, and rank 0 prints ``CHECK <impl>.<check> OK|SKIP <why>|FAIL rank r: <why>; ...``
  (tests/mpi_scripts/verdicts.py). ``--also`` runs the implementation-specific checks of
  tests/mpi_scripts/<MODULE>.py in the same launch, so one ``mpiexec`` per world size (the ``comm_job``
  fixture of tests/conftest.py) serves this file, tests/test_comm_mpi.py and tests/test_comm_shm.py.

Expected values are computed from rank numbers. The data (:func:`data`) make every sum, maximum and minimum
exact in any order and in every dtype, so one reference fits every summation order; float32/float64 values
carry bits below 16-bit precision, so a lossy communicator's rounding shows. A check's mismatches are
collected (:class:`Findings`) and raised at its end, after every rank ran all of its collectives, so a wrong
value on one rank never leaves the others waiting.

Lossy transfers: a communicator whose :attr:`~mpicrossbow.comm.base.Communicator.exact` is another one (the
compressed wrapper) delivers what :func:`reduced` and :func:`delivered` model: buffers it ``compresses()``
are rounded to its wire type before the operation (and a sum's result once more), point-to-point messages
keep their last ``EXACT_TAIL`` values bit-exact; everything else arrives exactly. Which buffers it
compresses, and the rest of its own behaviour, are tested in tests/test_comm_compressed.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import sys
import time
import unittest
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

from conftest import COMM_JOB_SIZES, CommJob, run_mpi, verdicts
from mpicrossbow.comm import CompressedCommunicator, ReduceOp
from mpicrossbow.comm.base import Communicator
from mpicrossbow.comm.compressed import EXACT_TAIL
from mpicrossbow.comm.forwarding import ForwardingCommunicator
from mpicrossbow.testing import InProcessWorld

N = 100_003  # a rendezvous-size message for MPI, not a multiple of any world size
SMALL = 1000  # below the compressed wrapper's threshold (1024 elements): never rounded
MID = 1500  # above it, and eager-size for MPI
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.float16, torch.bfloat16)
FINE = 1 + 2.0**-30  # lost in float32 and in every 16-bit type
FOLD = {ReduceOp.SUM: torch.add, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}
HERE = Path(__file__).resolve()


@dataclasses.dataclass(frozen=True)
class Subject:
    """One implementation under test: its communicator, the device of the tensors, and what it declares where
    the contract leaves a choice."""

    comm: Communicator
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    #: float16/bfloat16 sums accumulate in float32 and are rounded once (MPI, shared memory, in-process);
    #: False where they are reduced natively (Gloo, NCCL), the rounding then depending on the order.
    sums_16bit_in_float32: bool = True
    #: A non-contiguous tensor may be reduced (in-process); False: it must be refused with ValueError.
    takes_non_contiguous: bool = False
    #: A rank may send to itself (Gloo cannot).
    sends_to_self: bool = True
    #: Messages are matched by tag (NCCL has no tags).
    tags: bool = True
    #: Point-to-point messages are carried; False: ``isend``/``irecv`` refuse with NotImplementedError at
    #: once (replica groups' linked communicator: the rules that send are refused before training).
    point_to_point: bool = True
    #: The communicator can be split; False: ``split`` refuses with NotImplementedError at once.
    splits: bool = True
    #: The ranks that share this rank's node, in order; None: every rank (one machine).
    node: tuple[int, ...] | None = None


class Findings:
    """The mismatches one check found on this rank, kept until its end so every rank runs the check's
    collectives to the last; :meth:`settle` raises them all in one AssertionError."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def true(self, ok: bool, what: str) -> None:
        """Record ``what`` unless ``ok``."""
        if not ok:
            self.errors.append(what)

    def equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        """Record a mismatch unless ``got`` (any device) equals ``want`` in dtype, shape and every value."""
        got, want = got.detach().cpu(), want.detach().cpu()
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            self.errors.append(
                f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
            )
        elif not torch.equal(got, want):
            bad = (got != want).flatten().nonzero().flatten()[:3].tolist()
            flat_got, flat_want = got.flatten(), want.flatten()
            self.errors.append(
                f"{what}: {int((got != want).sum())} values differ, e.g. at {bad} got "
                f"{[flat_got[i].item() for i in bad]} want {[flat_want[i].item() for i in bad]}"
            )

    def settle(self) -> None:
        """Raise one AssertionError listing every mismatch, if any."""
        if self.errors:
            raise AssertionError("; ".join(self.errors))


def data(
    rank: int, numel: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Rank-specific values: integers 0..16 plus, for float32/float64, multiples of 2^-10 (below 16-bit
    precision) and, for int32/int64, an offset ``(rank + 1) * 2^20 + 1`` (not exact in 16 bits). Sums over up
    to 15 ranks are exact in every dtype and any order. A fresh tensor each call."""
    return _data(rank, numel, dtype).to(device, copy=True)


@functools.lru_cache(maxsize=512)
def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    i = torch.arange(numel, dtype=torch.int64)
    whole = (i * (rank + 1) + 3 * rank) % 17
    if dtype in (torch.float32, torch.float64):
        values = whole.double() + ((i * 37 + 101 * rank) % 1024).double() / 1024
    elif dtype in (torch.int32, torch.int64):
        values = whole + (rank + 1) * 2**20 + 1
    else:
        values = whole
    return values.to(dtype)


def wire_of(comm: Communicator, dtype: torch.dtype, numel: int) -> torch.dtype | None:
    """The 16-bit type ``comm`` rounds a ``numel`` x ``dtype`` buffer to, or None when it travels exactly."""
    if isinstance(comm, CompressedCommunicator) and comm.compresses(
        torch.empty(numel, dtype=dtype, device="meta")
    ):
        return comm.wire
    return None


def rounded(t: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """``t`` through ``wire`` and back (``t`` itself when ``wire`` is None)."""
    return t if wire is None else t.to(wire).to(t.dtype)


def reduced(
    comm: Communicator, op: ReduceOp, ranks: Iterable[int], numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """What ``comm.allreduce(data(r, numel, dtype), op)`` leaves on every rank of ``ranks`` (CPU; shared
    between calls: compare, never modify)."""
    return _reduced(wire_of(comm, dtype, numel), op, tuple(ranks), numel, dtype)


@functools.lru_cache(maxsize=512)
def _reduced(
    wire: torch.dtype | None, op: ReduceOp, ranks: tuple[int, ...], numel: int, dtype: torch.dtype
) -> torch.Tensor:
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    terms = [rounded(_data(r, numel, dtype), wire).to(wide) for r in ranks]
    acc = terms[0]
    for term in terms[1:]:
        acc = FOLD[op](acc, term)
    return rounded(acc.to(dtype), wire).clone()  # never the cached data itself


def delivered(comm: Communicator, sent: torch.Tensor) -> torch.Tensor:
    """What a message of ``sent`` arrives as over ``comm``: rounded where compressed, its last
    ``EXACT_TAIL`` values bit-exact."""
    wire = wire_of(comm, sent.dtype, sent.numel())
    if wire is None or sent.numel() <= EXACT_TAIL:
        return sent.clone()
    out = rounded(sent, wire)
    out[-EXACT_TAIL:] = sent[-EXACT_TAIL:]
    return out


def refuses_messages(s: Subject, f: Findings) -> bool:
    """Where the subject carries no point-to-point messages: whether ``isend`` and ``irecv`` refused with
    NotImplementedError (recorded when not), and True: the check ends there, on every rank alike."""
    if s.point_to_point:
        return False
    c = s.comm
    for name, call in (("isend", c.isend), ("irecv", c.irecv)):
        try:
            call(torch.zeros(3, device=s.device), (c.rank + 1) % c.size, 7)
            f.true(False, f"{name} was accepted, though the subject says it carries no messages")
        except NotImplementedError:
            pass
    f.settle()
    return True


def neighbours(s: Subject) -> tuple[int, int]:
    """(right, left) in the ring of ranks; skips the check where the ring is one rank that cannot send to
    itself."""
    if s.comm.size == 1 and not s.sends_to_self:
        raise unittest.SkipTest("one rank, and this implementation cannot send to itself")
    return (s.comm.rank + 1) % s.comm.size, (s.comm.rank - 1) % s.comm.size


# ------------------------------------------------------------------------------------------ the contract


def check_allreduce(s: Subject, f: Findings) -> None:
    """SUM of every dtype at odd sizes, MAX and MIN; a blocking call returns a completed handle."""
    c, dev = s.comm, s.device
    cases = [(ReduceOp.SUM, dtype, numel) for dtype in DTYPES for numel in (1, 7, SMALL, N)]
    cases += [
        (op, dtype, numel)
        for op in (ReduceOp.MAX, ReduceOp.MIN)
        for dtype, numel in (
            (torch.float32, SMALL),
            (torch.float32, N),
            (torch.int32, SMALL),
            (torch.bfloat16, SMALL),
        )
    ]
    for op, dtype, numel in cases:
        t = data(c.rank, numel, dtype, dev)
        handle = c.allreduce(t, op)
        f.true(handle.test(), f"blocking allreduce {op.name} {dtype} x {numel} returned a pending handle")
        f.equal(t, reduced(c, op, range(c.size), numel, dtype), f"allreduce {op.name} {dtype} x {numel}")
    if (
        wire_of(c, torch.float32, N) is not None
    ):  # the data must lose bits on the wire, or this proves nothing
        f.true(
            not torch.equal(
                reduced(c, ReduceOp.SUM, range(c.size), N), reduced(c.exact, ReduceOp.SUM, range(c.size), N)
            ),
            "test data survive the wire type unrounded",
        )
    f.settle()


def check_allreduce_async(s: Subject, f: Findings) -> None:
    """Several ``async_op=True`` allreduces in flight at once; each result is there after ``wait()``, and
    ``test()`` is True then."""
    c, dev = s.comm, s.device
    cases = [
        (ReduceOp.SUM, dtype, N) for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64)
    ]
    cases += [
        (op, dtype, 1001) for op in (ReduceOp.MAX, ReduceOp.MIN) for dtype in (torch.float32, torch.bfloat16)
    ]
    tensors = [data(c.rank, numel, dtype, dev) for _, dtype, numel in cases]
    handles = [c.allreduce(t, op, async_op=True) for t, (op, _, _) in zip(tensors, cases, strict=True)]
    for t, handle, (op, dtype, numel) in zip(tensors, handles, cases, strict=True):
        handle.wait()
        f.true(handle.test(), f"async allreduce {op.name} {dtype}: test() is False after wait()")
        f.equal(
            t, reduced(c, op, range(c.size), numel, dtype), f"async allreduce {op.name} {dtype} x {numel}"
        )
    f.settle()


def check_sums_16bit_in_float32(s: Subject, f: Findings) -> None:
    """float16/bfloat16 sums are taken in float32 and rounded once: rank 0 holds 1, the others half an ulp of
    1 each, which a 16-bit accumulator would drop at every step."""
    if not s.sums_16bit_in_float32:
        raise unittest.SkipTest("16-bit sums are reduced natively here")
    c = s.comm
    for dtype, half_ulp in ((torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)):
        for numel in (1, N):
            t = torch.full((numel,), 1.0 if c.rank == 0 else half_ulp, dtype=dtype, device=s.device)
            c.allreduce(t)
            want = torch.full((numel,), 1 + (c.size - 1) * half_ulp, dtype=torch.float64).to(dtype)
            f.equal(t, want, f"{dtype} x {numel} sum of 1 and {c.size - 1} x {half_ulp}")
    f.settle()


def check_in_place(s: Subject, f: Findings) -> None:
    """allreduce and broadcast write into the tensor's own storage: a view taken before sees the result."""
    c = s.comm
    t = data(c.rank, N, device=s.device)
    ptr, window = t.data_ptr(), t[10:20]
    c.allreduce(t)
    f.true(t.data_ptr() == ptr, "allreduce replaced the tensor's storage")
    f.equal(window, reduced(c, ReduceOp.SUM, range(c.size), N)[10:20], "view into the reduced tensor")
    root = c.size - 1
    b = data(c.rank, N, device=s.device)
    window = b[-20:-10]
    c.broadcast(b, root)
    f.equal(
        window,
        rounded(data(root, N), wire_of(c, torch.float32, N))[-20:-10],
        "view into the broadcast tensor",
    )
    f.settle()


def check_share(s: Subject, f: Findings) -> None:
    """``share`` (a pool's flat buffer, placed for the exchange) keeps the values, and a view taken before it
    keeps seeing the tensor: sums of the whole tensor and of a slice land in both, every step alike."""
    c = s.comm
    t = data(c.rank, N, device=s.device)
    window = t[10:20]
    c.share(t)
    f.equal(t, data(c.rank, N, device=s.device), "share changed the values")
    for step in range(2):
        t.copy_(data(c.rank, N, device=s.device))
        c.allreduce(t)
        want = reduced(c, ReduceOp.SUM, range(c.size), N)
        f.equal(t, want, f"step {step}: sum of the shared tensor")
        f.equal(window, want[10:20], f"step {step}: view taken before share")
        t[: N // 2].copy_(data(c.rank, N // 2, device=s.device))
        c.allreduce(t[: N // 2])
        f.equal(t[: N // 2], reduced(c, ReduceOp.SUM, range(c.size), N // 2), f"step {step}: sum of a slice")
    f.settle()


def check_allreduce_mean(s: Subject, f: Findings) -> None:
    """``allreduce_mean(t, k)`` leaves exactly what ``allreduce(t)`` then ``t.div_(k)`` leaves, on a shared
    tensor (the pool's flat buffer, where an implementation may divide inside its reduction) and a plain one;
    ``k = 1`` is the sum."""
    c = s.comm
    shared = data(c.rank, N, device=s.device)
    c.share(shared)
    for label, t in (("shared", shared), ("plain", data(c.rank, N, device=s.device))):
        for count in (1, 3 * c.size):
            t.copy_(data(c.rank, N, device=s.device))
            c.allreduce_mean(t, count)
            # divided where t lives: CUDA divides by a scalar as a multiply by its reciprocal, which can
            # differ from the CPU's division in the last bit
            want = reduced(c, ReduceOp.SUM, range(c.size), N).to(s.device)
            f.equal(t, want / count if count != 1 else want, f"{label} mean over {count}")
    f.settle()


def check_broadcast(s: Subject, f: Findings) -> None:
    """From every root, blocking and async, several dtypes: every rank (the root too) ends with the root's
    values as they travel."""
    c = s.comm
    cases = [
        (torch.float32, SMALL, False),
        (torch.float32, N, False),
        (torch.float32, N, True),
        (torch.bfloat16, SMALL, False),
        (torch.int64, SMALL, False),
        (torch.uint8, SMALL, False),
        (torch.float16, N, True),
    ]
    for root in range(c.size):
        for dtype, numel, async_op in cases:
            t = data(c.rank, numel, dtype, s.device)
            handle = c.broadcast(t, root, async_op=async_op)
            handle.wait()
            f.true(handle.test(), f"broadcast from {root}: test() is False after wait()")
            want = rounded(data(root, numel, dtype), wire_of(c, dtype, numel))
            f.equal(t, want, f"broadcast {dtype} x {numel} from {root} async={async_op}")
    f.settle()


def check_ring(s: Subject, f: Findings) -> None:
    """isend/irecv around the ring, the receive posted first, large and small messages."""
    if refuses_messages(s, f):
        return
    c = s.comm
    right, left = neighbours(s)
    for dtype, numel in ((torch.float32, N), (torch.bfloat16, N), (torch.float64, 5)):
        into = torch.zeros(numel, dtype=dtype, device=s.device)
        recv = c.irecv(into, left, tag=7)
        send = c.isend(data(c.rank, numel, dtype, s.device), right, tag=7)
        recv.wait()
        send.wait()
        f.true(recv.test() and send.test(), "test() is False after wait()")
        f.equal(into, delivered(c, data(left, numel, dtype)), f"ring {dtype} x {numel} from rank {left}")
    f.settle()


def check_isend_temporary(s: Subject, f: Findings) -> None:
    """A send of a temporary (freed by reference counting as ``isend`` returns, unless the handle keeps what
    is on the wire) still delivers, the receive posted only after every rank has sent."""
    if refuses_messages(s, f):
        return
    c = s.comm
    right, left = neighbours(s)
    send = c.isend(data(c.rank, N, device=s.device), right, tag=8)
    c.barrier()  # every rank has sent before any receive is posted
    into = torch.zeros(N, device=s.device)
    c.irecv(into, left, tag=8).wait()
    send.wait()
    f.equal(into, delivered(c, data(left, N)), f"temporary sent by rank {left}")
    f.settle()


def check_tags(s: Subject, f: Findings) -> None:
    """Tags 1 then 2 are sent; the receives are posted tag 2 first, and each gets its own message."""
    if refuses_messages(s, f):
        return
    if not s.tags:
        raise unittest.SkipTest("no message tags here")
    c = s.comm
    right, left = neighbours(s)
    sends = [c.isend(data(c.rank + tag, MID, device=s.device), right, tag=tag) for tag in (1, 2)]
    second, first = torch.zeros(MID, device=s.device), torch.zeros(MID, device=s.device)
    for handle in [c.irecv(second, left, tag=2), c.irecv(first, left, tag=1), *sends]:
        handle.wait()
    f.equal(first, delivered(c, data(left + 1, MID)), "tag 1")
    f.equal(second, delivered(c, data(left + 2, MID)), "tag 2")
    f.settle()


def check_fifo(s: Subject, f: Findings) -> None:
    """Messages on one (source, tag) channel arrive in order, whatever the order of the waits; ``test()`` on
    a receive whose message was not sent yet returns False without blocking."""
    if refuses_messages(s, f):
        return
    if not s.tags:
        raise unittest.SkipTest("no message tags here")
    c = s.comm
    neighbours(s)  # (skips where one rank cannot send to itself)
    receiver, sender = 0, c.size - 1
    into = [torch.zeros(MID, device=s.device) for _ in range(2)]
    recvs = [c.irecv(t, sender, tag=5) for t in into] if c.rank == receiver else []
    f.true(not any(h.test() for h in recvs), "test() reported a receive complete before anything was sent")
    c.barrier()
    sends = (
        [c.isend(data(sender + i, MID, device=s.device), receiver, tag=5) for i in (0, 1)]
        if c.rank == sender
        else []
    )
    for handle in [*recvs[::-1], *sends]:
        handle.wait()
    f.true(all(h.test() for h in recvs), "test() is False after wait()")
    for i, t in enumerate(into if c.rank == receiver else []):
        f.equal(t, delivered(c, data(sender + i, MID)), f"message {i} from rank {sender} on one channel")
    f.settle()


def check_barrier(s: Subject, f: Findings) -> None:
    """No rank leaves the barrier before the last one (they arrive 20 ms apart) entered it."""
    c = s.comm
    time.sleep(0.02 * c.rank)
    entered = time.time()
    c.barrier()
    left = time.time()
    (last_in,) = c.allreduce_scalars([entered], ReduceOp.MAX)
    (first_out,) = c.allreduce_scalars([left], ReduceOp.MIN)
    f.true(
        first_out >= last_in, f"a rank left the barrier {last_in - first_out:.3f}s before the last entered"
    )
    f.settle()


def check_split(s: Subject, f: Findings) -> None:
    """Evens and odds, each ordered by key (reverse rank); collectives and messages stay inside each; a split
    of the split; a split is as lossy as its parent; close() is idempotent and closes the nested split.
    (A subject that cannot split refuses at once with NotImplementedError.)"""
    if not s.splits:
        try:
            s.comm.split(0)
            f.true(False, "split was accepted, though the subject says it cannot split")
        except NotImplementedError:
            pass
        f.settle()
        return
    c, dev = s.comm, s.device
    sub = c.split(c.rank % 2, key=-c.rank)
    members = sorted((r for r in range(c.size) if r % 2 == c.rank % 2), reverse=True)
    f.true((sub.rank, sub.size) == (members.index(c.rank), len(members)), f"split gave {sub!r}")
    f.true((sub.exact is sub) == (c.exact is c), "a split of a lossy communicator is exact, or the reverse")
    t = data(c.rank, N, device=dev)
    sub.allreduce(t)
    f.equal(t, reduced(sub, ReduceOp.SUM, members, N), "split allreduce")
    t = data(c.rank, SMALL, device=dev)
    sub.broadcast(t, root=0)
    f.equal(t, data(members[0], SMALL), "split broadcast from the key-first rank")
    if sub.size > 1 or s.sends_to_self:
        right, left = (sub.rank + 1) % sub.size, (sub.rank - 1) % sub.size
        into = torch.zeros(MID, device=dev)
        recv = sub.irecv(into, left, tag=3)
        sub.isend(data(c.rank, MID, device=dev), right, tag=3).wait()
        recv.wait()
        f.equal(into, delivered(sub, data(members[left], MID)), "split ring")
    nested = sub.split(0, key=sub.size - sub.rank)  # the same members, in rank order again
    t = torch.full((3,), float(c.rank), device=dev)
    nested.allreduce(t)
    f.true(nested.rank == members[::-1].index(c.rank), f"nested split gave {nested!r}")
    f.equal(t, torch.full((3,), float(sum(members))), "nested split allreduce")
    sub.close()
    sub.close()
    f.settle()


def check_split_node(s: Subject, f: Findings) -> None:
    """The ranks of this rank's node (on one machine: every rank), in rank order."""
    c = s.comm
    members = s.node if s.node is not None else tuple(range(c.size))
    node = c.split_node()
    f.true((node.rank, node.size) == (members.index(c.rank), len(members)), f"split_node gave {node!r}")
    f.true(
        (node.exact is node) == (c.exact is c),
        "a node split of a lossy communicator is exact, or the reverse",
    )
    t = data(c.rank, N, device=s.device)
    node.allreduce(t)
    f.equal(t, reduced(node, ReduceOp.SUM, members, N), "split_node allreduce")
    node.close()
    f.settle()


def check_scalars(s: Subject, f: Findings) -> None:
    """Metrics, counters and flags (float64, few values) are reduced exactly: ``allreduce_scalars`` SUM and
    MAX, and a one-value float64 MAX."""
    c = s.comm
    got = c.allreduce_scalars([float(c.rank), 1.0, FINE])
    f.true(
        got == [float(sum(range(c.size))), float(c.size), c.size * FINE], f"allreduce_scalars SUM gave {got}"
    )
    got = c.allreduce_scalars([FINE * (c.rank + 1)], ReduceOp.MAX)
    f.true(got == [FINE * c.size], f"allreduce_scalars MAX gave {got}")
    flag = torch.tensor([FINE * (c.rank + 1)], dtype=torch.float64, device=s.device)
    c.allreduce(flag, ReduceOp.MAX, async_op=True).wait()
    f.true(flag.item() == FINE * c.size, f"float64 flag MAX gave {flag.item()!r}")
    f.settle()


def check_exact(s: Subject, f: Findings) -> None:
    """``exact`` is the same ranks without rounding: the communicator itself unless it compresses."""
    c = s.comm
    e = c.exact
    f.true(e.exact is e, "exact of exact is another communicator")
    f.true((e.rank, e.size) == (c.rank, c.size), f"exact is {e!r}, the communicator {c!r}")
    f.true((e is c) != isinstance(c, CompressedCommunicator), f"exact of {c!r} is {e!r}")
    t = data(c.rank, N, device=s.device)
    e.allreduce(t)
    f.equal(t, reduced(e, ReduceOp.SUM, range(c.size), N), "allreduce through exact")
    f.settle()


def check_non_contiguous(s: Subject, f: Findings) -> None:
    """A transposed tensor, small and large, is refused with ValueError (or, where the implementation takes
    non-contiguous tensors, reduced correctly)."""
    c = s.comm
    for side in (4, 300):
        t = data(c.rank, side * side, device=s.device).view(side, side).t()
        try:
            c.allreduce(t)
        except ValueError:
            continue
        f.true(s.takes_non_contiguous, f"a transposed {side}x{side} tensor was accepted")
        if s.takes_non_contiguous:
            want = reduced(c, ReduceOp.SUM, range(c.size), side * side).view(side, side).t()
            f.equal(t, want, f"transposed {side}x{side} allreduce")
    f.settle()


def check_close(s: Subject, f: Findings) -> None:
    """close() releases the communicator and may be called again (the last check: it ends the subject)."""
    s.comm.close()
    s.comm.close()
    f.settle()


Check = Callable[[Subject, Findings], None]
#: The contract, in the order it runs (``close`` last).
CONTRACT: dict[str, Check] = {
    name[len("check_") :]: fn for name, fn in list(globals().items()) if name.startswith("check_")
}


def run_check(check: Check, subject: Subject) -> None:
    """Run one contract check on this rank; raises AssertionError listing its mismatches."""
    findings = Findings()
    check(subject, findings)
    findings.settle()


# ---------------------------------------------------------------------------------- binding 1: in process


#: In-process implementations, each made from the rank's InProcessCommunicator.
IN_PROCESS: dict[str, Callable[[Communicator], Subject]] = {
    "inprocess": lambda comm: Subject(comm, takes_non_contiguous=True),
    "inprocess+bf16": lambda comm: Subject(
        CompressedCommunicator(comm, torch.bfloat16), takes_non_contiguous=True
    ),
    "inprocess+fp16": lambda comm: Subject(
        CompressedCommunicator(comm, torch.float16), takes_non_contiguous=True
    ),
    "inprocess+forwarding": lambda comm: Subject(ForwardingCommunicator(comm), takes_non_contiguous=True),
}


@pytest.mark.parametrize("check", list(CONTRACT))
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("impl", list(IN_PROCESS))
def test_contract_in_process(impl: str, size: int, check: str) -> None:
    """One contract check on every rank of an in-process world (a failing rank is named in the error)."""
    InProcessWorld(size, timeout_s=30).run(lambda comm: run_check(CONTRACT[check], IN_PROCESS[impl](comm)))


def linked_run(size: int, groups: int, check: Check) -> None:
    """``check`` on every rank of a :class:`~mpicrossbow.comm.linked.LinkedCommunicator`: ``groups``
    replica groups of ``size // groups`` in-process ranks each (a split of one in-process world), their first
    ranks linked over Gloo on this machine (:class:`~mpicrossbow.comm.group_link.GroupLink`, as threads)."""
    from slurm_cluster import free_ports

    from mpicrossbow.comm.group_link import GroupLink
    from mpicrossbow.comm.linked import LinkedCommunicator

    (port,) = free_ports(1)
    per = size // groups

    def rank(comm: Communicator) -> None:
        group = comm.rank // per
        inner = comm.split(group, key=comm.rank)
        link = GroupLink("127.0.0.1", port, group, groups) if inner.rank == 0 else None
        linked = None
        try:  # the link closed whatever happens: a check that skips (or fails) at once aborts the in-process
            # world, and a rank aborted while building its communicator once left its link open, its
            # heartbeat beating on while group 0's leader waited its 30 s for it to leave (1 run in 5)
            linked = LinkedCommunicator(inner, link, group, groups)
            node = tuple(range(group * per, (group + 1) * per))  # a group is a node (or a set of nodes)
            # Gloo sums 16-bit types natively; in-process groups take a transposed tensor, as the link does
            subject = Subject(linked, sums_16bit_in_float32=False, takes_non_contiguous=True,
                              point_to_point=False, splits=False, node=node)  # fmt: skip
            run_check(check, subject)
        finally:
            if check is not check_close:
                if linked is not None:
                    linked.close()
                elif link is not None:
                    link.close()

    InProcessWorld(size, timeout_s=60).run(rank)


@pytest.mark.parametrize("check", list(CONTRACT))
@pytest.mark.parametrize(("size", "groups"), [(2, 2), (4, 2)])
def test_contract_linked(size: int, groups: int, check: str) -> None:
    """One contract check on every rank of replica groups joined by the link (the rules' communicator under
    ``[link] groups``): the collectives cross the groups; messages and splits are refused at once."""
    linked_run(size, groups, CONTRACT[check])


# ------------------------------------------------------------------------------- binding 2: under mpiexec


def mpi_subjects(cuda: bool) -> dict[str, Callable[[], Subject | str]]:
    """The MPI-launched implementations by name, each a constructor (collective) returning its subject, or a
    string saying why it cannot run here."""
    from mpi4py import MPI

    from mpicrossbow.comm import make_communicator
    from mpicrossbow.comm.mpi import MPICommunicator, mpi_cuda_aware
    from mpicrossbow.comm.shm import SharedMemoryCommunicator
    from mpicrossbow.comm.torchdist import TorchDistCommunicator
    from mpicrossbow.config import CommSection

    if not cuda:
        return {
            "mpi": lambda: Subject(MPICommunicator()),
            "mpi+shm": lambda: Subject(SharedMemoryCommunicator(MPI.COMM_WORLD)),
            # elastic training's: the window in descriptor-backed memory, waits asking MPI for failures
            "mpi+shm+notice": lambda: Subject(SharedMemoryCommunicator(MPI.COMM_WORLD, notice_failures=True)),
            "gloo": lambda: Subject(
                TorchDistCommunicator.from_mpi(backend="gloo", timeout_s=60),
                sums_16bit_in_float32=False,
                sends_to_self=False,
            ),
            # the path CPU tensors take under NCCL (a copy on the device, the result copied back), run here
            # with the CPU as that device
            "gloo-staged": lambda: Subject(
                staged_through_cpu(TorchDistCommunicator.from_mpi(backend="gloo", timeout_s=60)),
                sums_16bit_in_float32=False,
                sends_to_self=False,
            ),
            # as the session builds it: over shared memory when a node holds several ranks, and over plain MPI
            "mpi+bf16": lambda: Subject(
                make_communicator(CommSection(backend="mpi", compression="bf16"), "cpu")
            ),
            "mpi+fp16": lambda: Subject(
                make_communicator(CommSection(backend="mpi", compression="fp16", shared_memory="off"), "cpu")
            ),
        }
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    gpus = torch.cuda.device_count()
    dev = torch.device("cuda", local.Get_rank() % max(gpus, 1))

    def staged() -> Subject:
        os.environ["MPICROSSBOW_CUDA_AWARE"] = "0"
        try:
            return Subject(MPICommunicator(), device=dev)
        finally:
            del os.environ["MPICROSSBOW_CUDA_AWARE"]

    def nccl(device: torch.device) -> Subject | str:
        if local.allreduce(1) > gpus:
            return "fewer GPUs than ranks on a node"
        comm = TorchDistCommunicator.from_mpi(backend="nccl", timeout_s=60)
        return Subject(comm, device=device, sums_16bit_in_float32=False, sends_to_self=False, tags=False)

    if gpus:
        torch.cuda.set_device(dev)
    return {
        "mpi-staged": staged,
        "mpi-cuda-aware": lambda: (
            Subject(MPICommunicator(), device=dev)
            if mpi_cuda_aware()
            else "this MPI does not report CUDA support"
        ),
        "nccl": lambda: nccl(dev),
        # CPU tensors under NCCL (the training loop's stop flag, a rule's timings): staged through the GPU
        "nccl-cpu-tensors": lambda: nccl(torch.device("cpu")),
    }


def staged_through_cpu(comm: Communicator) -> Communicator:
    """``comm`` (a TorchDistCommunicator) with its CPU tensors staged through a copy, as under NCCL."""
    comm.stage_cpu_through = torch.device("cpu")  # type: ignore[attr-defined]
    return comm


#: Contract checks left out on CUDA tensors (never run there so far).
CUDA_LEFT_OUT = ("barrier", "isend_temporary", "fifo")


def main() -> int:
    """Rank side: run the contract on each named implementation, then each ``--also`` module's ``CHECKS``."""
    from verdicts import finish, run_checks, say

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("impls", nargs="*", help="implementations (default: all of the device's)")
    parser.add_argument("--cuda", action="store_true", help="CUDA tensors and the GPU implementations")
    parser.add_argument("--also", action="append", default=[], help="a tests/mpi_scripts module with CHECKS")
    args = parser.parse_args()
    extra = [(name, importlib.import_module(name).CHECKS) for name in args.also]  # before any window exists
    if args.cuda and not torch.cuda.is_available():
        say("CHECK cuda SKIP no CUDA device")
        return finish(True)
    subjects = mpi_subjects(args.cuda)
    ok = True
    for impl in args.impls or list(subjects):
        subject = subjects[impl]()
        if isinstance(subject, str):
            say(f"CHECK {impl} SKIP {subject}")
            continue
        checks = [(n, fn) for n, fn in CONTRACT.items() if not (args.cuda and n in CUDA_LEFT_OUT)]
        ok &= run_checks(impl, [(n, lambda fn=fn, s=subject: run_check(fn, s)) for n, fn in checks])
    for label, checks in extra:
        ok &= run_checks(label, checks)
    return finish(ok)


def impl_problems(job: CommJob, impl: str, expected: Iterable[str]) -> list[str]:
    """The expected checks of ``impl`` that the job did not report OK or SKIP, with their verdicts."""
    found = job.verdicts(impl)
    return [
        f"{impl}.{name}: {found.get(name, 'not reported')}"
        for name in expected
        if not (found.get(name) == "OK" or found.get(name, "").startswith("SKIP"))
    ]


#: The implementations the CPU job runs the contract on.
MPI_IMPLS = ("mpi", "mpi+shm", "mpi+shm+notice", "gloo", "gloo-staged", "mpi+bf16", "mpi+fp16")


@pytest.mark.mpi
@pytest.mark.parametrize("impl", MPI_IMPLS)
@pytest.mark.parametrize("n", COMM_JOB_SIZES)
def test_contract_under_mpiexec(comm_job: Callable[[int], CommJob], n: int, impl: str) -> None:
    """Every contract check passes on every rank of ``mpiexec -n n`` for ``impl`` (one job per world size
    runs them all)."""
    job = comm_job(n)
    problems = impl_problems(job, impl, CONTRACT)
    assert not problems, "\n".join(problems) + job.tail()


@pytest.mark.mpi
@pytest.mark.parametrize("n", COMM_JOB_SIZES)
def test_job_ends_cleanly(comm_job: Callable[[int], CommJob], n: int) -> None:
    """The communicator job of world size n reports every check and exits 0: nothing failed, and closing
    windows, groups and MPI itself went through."""
    job = comm_job(n)
    assert job.returncode == 0 and "DONE" in job.stdout, job.tail()


@pytest.mark.mpi
@pytest.mark.cuda
def test_contract_on_cuda(mpiexec: str) -> None:
    """CUDA tensors: MPI staged through pinned memory, CUDA-aware MPI when supported, and NCCL (over 2 ranks
    where there are 2 GPUs, else over one), with CUDA tensors and with CPU tensors staged through the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    on_cuda = [n for n in CONTRACT if n not in CUDA_LEFT_OUT]
    proc = run_mpi(mpiexec, 2, [sys.executable, str(HERE), "--cuda"], timeout=300)
    job = CommJob(2, proc.returncode, proc.stdout, proc.stderr)
    failed = [f"{name}: {v}" for name, v in verdicts(proc.stdout).items() if v.startswith("FAIL")]
    assert not failed, "\n".join(failed) + job.tail()
    assert not impl_problems(job, "mpi-staged", on_cuda), job.tail()
    assert proc.returncode == 0 and "DONE" in proc.stdout, job.tail()
    if torch.cuda.device_count() < 2:  # NCCL needs a GPU per rank: one rank then, which it serves too
        nccl_impls = ["nccl", "nccl-cpu-tensors"]
        proc = run_mpi(mpiexec, 1, [sys.executable, str(HERE), "--cuda", *nccl_impls], timeout=300)
        job = CommJob(1, proc.returncode, proc.stdout, proc.stderr)
        assert proc.returncode == 0 and "DONE" in proc.stdout, job.tail()
    for impl in ("nccl", "nccl-cpu-tensors"):
        assert not impl_problems(job, impl, on_cuda), job.tail()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent / "mpi_scripts"))
    from verdicts import run_main

    run_main(main)
