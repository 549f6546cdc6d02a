"""The pipelined staging of a device allreduce (mpicrossbow/comm/staged_pipeline.py), on the CPU and a GPU.

On the CPU the pipeline drives :class:`RecordingDevice`, a stand-in for a CUDA device: its "device"
tensors are CPU tensors and its two copy streams are queues of deferred CPU copies, run only when something
forces them (a host wait on an event, a later copy of the same stream, an ``after`` dependency), or at once,
or at random points (``schedule``), as a GPU may run them any time after they are queued. Every operation is
logged (issue, run, wait, and the reductions the test's host reduction logs), and hooks see each log entry.
So a pipeline that omits a wait both reads stale memory (a wrong sum) and leaves a trace that
:func:`ordering_problems` names. The host reductions are real: in-process ranks (threads,
:class:`~mpicrossbow.testing.InProcessWorld`), and under ``mpiexec -n 2`` MPICommunicator and
SharedMemoryCommunicator themselves.

This file is also the script the MPI ranks run (``python tests/test_staged_pipeline.py [--cuda]``); rank 0
prints ``CHECK staged.<name> OK|FAIL ...`` (tests/mpi_scripts/verdicts.py). ``--cuda`` runs the real CUDA
path of MPICommunicator (2 ranks, one GPU is enough); :func:`test_cuda_pipeline_in_process` runs the real
:class:`~mpicrossbow.comm.staged_pipeline.CudaStaging` in this process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_mpi, verdicts
from mpicrossbow.comm import ReduceOp
from mpicrossbow.comm.base import Communicator, DoneHandle, Handle
from mpicrossbow.comm.staged_pipeline import (
    STAGE_CHUNK_BYTES,
    STAGE_CHUNK_ENV,
    CudaStaging,
    StagedAllreduce,
    stage_chunk_bytes,
)
from mpicrossbow.testing import InProcessWorld

HERE = Path(__file__).resolve()
#: Every dtype MPICommunicator reduces (16-bit ones through float32).
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.float16, torch.bfloat16)
#: Tensor sizes in chunks: part of one, exactly one, exactly three, three and a half, many.
SIZES = (0.5, 1, 3, 3.5, 40.25)
CHUNK = 64  # bytes per chunk in the in-process tests: 16 float32, 64 uint8
SCHEDULES = ("lazy", "eager", "eager_out", "random")
GARBAGE = 0xFF  # what the stand-in's host halves hold before any copy: NaN, -1, 255


@dataclass
class Op:
    """A queued copy of the stand-in device: its stream, the chunk it moves, the copy, its dependency."""

    kind: str  # "out" (device -> host) or "in" (host -> device)
    chunk: int
    run: Callable[[], object]
    after: Op | None = None
    done: bool = False


class RecordingDevice:
    """A stand-in :class:`~mpicrossbow.comm.staged_pipeline.StagingDevice` for tests: deferred CPU copies on
    two queues ("streams"), every operation logged as ``(what, chunk)``.

    ``schedule``: when queued copies run besides when forced. ``lazy``: never (as late as allowed); ``eager``:
    at once; ``eager_out``: copies out at once, copies back lazily (a copy-out then overwrites a half as
    early as allowed); ``random``: a hook runs the next copy of a random stream at random log entries.
    """

    def __init__(self, chunk_bytes: int, schedule: str = "lazy", seed: int = 0) -> None:
        self.chunk_bytes = chunk_bytes
        self.schedule = schedule
        self.halves = [torch.full((chunk_bytes,), GARBAGE, dtype=torch.uint8) for _ in range(2)]
        self.streams: dict[str, list[Op]] = {"out": [], "in": []}
        self.log: list[tuple[str, int]] = []
        self.hooks: list[Callable[[str, int], None]] = []
        self._rng = random.Random(seed)
        if schedule == "random":
            self.hooks.append(self._maybe_advance)

    def record(self, what: str, chunk: int = -1) -> None:
        """Log one operation and show it to every hook."""
        self.log.append((what, chunk))
        for hook in self.hooks:
            hook(what, chunk)

    def begin(self) -> None:
        """Nothing to order after on the CPU; logged."""
        self.record("begin")

    def host(self, half: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Half ``half`` as ``numel`` elements of ``dtype``."""
        assert numel * dtype.itemsize <= self.chunk_bytes, "a chunk larger than a half"
        return self.halves[half][: numel * dtype.itemsize].view(dtype)

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor, after: Op | None) -> Op:
        """Queue ``dst.copy_(src)`` on the out stream, to run after ``after``."""
        return self._queue(Op("out", self._chunk(src), lambda: dst.copy_(src), after), eager="out")

    def copy_in(self, src: torch.Tensor, dst: torch.Tensor) -> Op:
        """Queue ``dst.copy_(src)`` on the in stream."""
        return self._queue(Op("in", self._chunk(dst), lambda: dst.copy_(src)), eager="")

    def wait(self, event: Op) -> None:
        """The host waits for ``event``: its stream runs up to it."""
        self.record(f"wait_{event.kind}", event.chunk)
        self._run(event)

    def _chunk(self, device_part: torch.Tensor) -> int:
        """Which chunk of the flat tensor (a fresh tensor, offset 0) a device-side view is."""
        return device_part.storage_offset() // max(1, self.chunk_bytes // device_part.element_size())

    def _queue(self, op: Op, eager: str) -> Op:
        self.streams[op.kind].append(op)
        self.record(f"issue_{op.kind}", op.chunk)
        if self.schedule == "eager" or (self.schedule == "eager_out" and eager == op.kind):
            self._run(op)
        return op

    def _run(self, op: Op) -> None:
        """Run ``op``'s stream in order up to ``op``, each copy after its dependency."""
        for queued in self.streams[op.kind]:
            if not queued.done:
                if queued.after is not None:
                    self._run(queued.after)
                queued.run()
                queued.done = True
                self.record(f"run_{queued.kind}", queued.chunk)
            if queued is op:
                return

    def _maybe_advance(self, what: str, chunk: int) -> None:
        """The ``random`` schedule's hook: at an issue, wait or reduction, maybe run one more queued copy."""
        if what.startswith("run_") or self._rng.random() < 0.4:
            return
        pending = [op for ops in self.streams.values() for op in ops[:] if not op.done]
        if pending:
            kind = self._rng.choice(sorted({op.kind for op in pending}))
            self._run(next(op for op in self.streams[kind] if not op.done))


def ordering_problems(log: list[tuple[str, int]], chunks: int) -> list[str]:
    """What a log shows out of order, for a tensor of ``chunks`` chunks; [] when the pipeline was right."""
    first = {}
    for index, entry in enumerate(log):
        first.setdefault(entry, index)

    def at(what: str, chunk: int = -1) -> float:
        return first.get((what, chunk), float("inf"))

    problems = []
    if at("begin") > at("issue_out", 0):
        problems.append("a copy-out was issued before begin()")
    for i in range(chunks):
        if not at("run_out", i) < at("reduce_start", i):
            problems.append(f"chunk {i} was reduced before its copy-out ran")
        if not at("wait_out", i) < at("reduce_start", i):
            problems.append(f"chunk {i} was reduced without waiting for its copy-out")
        if not at("reduce_end", i) < at("issue_in", i) <= at("run_in", i):
            problems.append(f"chunk {i} was copied back before its reduction finished")
        if i + 1 < chunks and not at("issue_out", i + 1) < at("reduce_start", i):
            problems.append(
                f"chunk {i + 1}'s copy-out was not issued before chunk {i}'s reduction (no overlap)"
            )
        if i + 2 < chunks and not at("run_in", i) < at("run_out", i + 2):
            problems.append(f"chunk {i + 2}'s copy-out overwrote a half before chunk {i}'s copy-back read it")
    if not at("run_in", chunks - 1) < at("return"):
        problems.append("returned before the last copy-back ran")
    return problems


def values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of ``dtype`` (uint8 small enough that sums of a few ranks fit)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 60, (numel,), generator=gen, dtype=dtype)
    return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)


def logging_reduce(
    allreduce: Callable[[torch.Tensor, ReduceOp], Handle], device: RecordingDevice, op: ReduceOp
) -> Callable[[torch.Tensor], None]:
    """The host reduction: a communicator's blocking ``allreduce``, its start and end logged (the i-th call
    reduces chunk i)."""
    count = itertools.count()

    def reduce(host: torch.Tensor) -> None:
        i = next(count)
        device.record("reduce_start", i)
        allreduce(host, op).wait()
        device.record("reduce_end", i)

    return reduce


def numel_for(chunks: float, dtype: torch.dtype, chunk_bytes: int = CHUNK) -> int:
    return int(chunks * (chunk_bytes // dtype.itemsize))


@dataclass
class Outcome:
    """One rank's run: its pipelined result, a plain allreduce of the same input, the log, the chunks."""

    got: torch.Tensor
    want: torch.Tensor
    log: list[tuple[str, int]]
    chunks: int


def run_pipeline(
    numel: int,
    dtype: torch.dtype = torch.float32,
    schedule: str = "lazy",
    ranks: int = 2,
    op: ReduceOp = ReduceOp.SUM,
    make: Callable[[RecordingDevice, int], StagedAllreduce[Op]] = StagedAllreduce,
) -> list[Outcome]:
    """Every in-process rank sums its own random tensor through the pipeline on a :class:`RecordingDevice`,
    and once through a plain allreduce of the whole tensor."""

    def rank(comm: Communicator) -> Outcome:
        flat = values(numel, dtype, seed=100 + comm.rank)
        want = flat.clone()
        comm.allreduce(want, op).wait()
        device = RecordingDevice(CHUNK, schedule, seed=comm.rank)
        make(device, CHUNK)(flat, logging_reduce(comm.allreduce, device, op))
        device.record("return")
        step = CHUNK // dtype.itemsize
        return Outcome(flat, want, device.log, -(-numel // step))

    return InProcessWorld(ranks).run(rank)


# -- results -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunks", SIZES)
def test_sum_equals_a_plain_allreduce(chunks: float, dtype: torch.dtype) -> None:
    """Bit for bit the plain allreduce's sum, whatever the size against the chunk and the dtype (16-bit ones
    summed in float32 by the host reduction, as the plain path does), under a random copy schedule."""
    for outcome in run_pipeline(numel_for(chunks, dtype), dtype, schedule="random"):
        assert torch.equal(outcome.got, outcome.want), (outcome.got, outcome.want)


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN], ids=lambda o: o.value)
def test_max_and_min(op: ReduceOp) -> None:
    """The reduction is whatever the host reduction does: MAX and MIN too, over three ranks."""
    for outcome in run_pipeline(numel_for(3.5, torch.float32), schedule="random", ranks=3, op=op):
        assert torch.equal(outcome.got, outcome.want)


def test_halves_and_events_carry_over_between_calls() -> None:
    """One pipeline, reused for several tensors (sizes and dtypes alike or not), as a communicator keeps it:
    the second call's copies into a half still wait for the first call's copy-back of it."""

    def rank(comm: Communicator) -> list[bool]:
        device = RecordingDevice(CHUNK, "eager_out", seed=comm.rank)
        pipeline = StagedAllreduce(device, CHUNK)
        same = []
        for call, dtype in enumerate((torch.float32, torch.bfloat16, torch.float32, torch.int64)):
            flat = values(numel_for(2.5 + call, dtype), dtype, seed=10 * call + comm.rank)
            want = flat.clone()
            comm.allreduce(want).wait()
            pipeline(flat, logging_reduce(comm.allreduce, device, ReduceOp.SUM))
            same.append(torch.equal(flat, want))
        return same

    assert InProcessWorld(2).run(rank) == [[True] * 4] * 2


def test_empty_tensor_and_bad_arguments() -> None:
    """An empty tensor costs nothing; a non-flat tensor and a chunk of no bytes are refused."""
    device = RecordingDevice(CHUNK)
    StagedAllreduce(device, CHUNK)(torch.empty(0), lambda host: None)
    assert device.log == []
    with pytest.raises(ValueError, match="flat contiguous"):
        StagedAllreduce(device, CHUNK)(torch.zeros(4, 4), lambda host: None)
    with pytest.raises(ValueError, match="positive"):
        StagedAllreduce(device, 0)


def test_a_failing_reduction_leaves_no_copy_pending() -> None:
    """If the host reduction raises, the error comes out and every queued copy has run first, so none is
    left writing into the pinned halves."""
    device = RecordingDevice(CHUNK, "lazy")

    def fail(host: torch.Tensor) -> None:
        raise RuntimeError("MPI failed")

    with pytest.raises(RuntimeError, match="MPI failed"):
        StagedAllreduce(device, CHUNK)(torch.ones(numel_for(3, torch.float32)), fail)
    assert all(op.done for ops in device.streams.values() for op in ops)


# -- ordering ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("chunks", [1, 3.5, 40.25])
def test_ordering_holds(schedule: str, chunks: float) -> None:
    """Under every copy schedule: a chunk is reduced only after its copy-out ran and was waited for, copied
    back only after its reduction, a half is overwritten only after the copy-back that read it, the next
    copy-out is issued before the reduction (the overlap), and the call returns after the last copy-back."""
    for outcome in run_pipeline(numel_for(chunks, torch.float32), schedule=schedule):
        assert ordering_problems(outcome.log, outcome.chunks) == []
        assert torch.equal(outcome.got, outcome.want)


class SerialStaging(StagedAllreduce[Op]):
    """Broken on purpose: copies chunk i+1 out only after chunk i is back (correct, but nothing overlaps)."""

    def __call__(self, flat: torch.Tensor, reduce: Callable[[torch.Tensor], None]) -> None:
        self.device.begin()
        chunks = list(flat.split(self.chunk_bytes // flat.element_size()))
        for i, chunk in enumerate(chunks):
            host = self._await_copy_out(self._copy_out(chunks, i), i, chunk)
            reduce(host)
            back = self._copy_back(host, chunk, i)
        self._finish(back)


class EarlyCopyBack(StagedAllreduce[Op]):
    """Broken on purpose: queues a chunk's copy-back before reducing it."""

    def __call__(self, flat: torch.Tensor, reduce: Callable[[torch.Tensor], None]) -> None:
        self.device.begin()
        chunks = list(flat.split(self.chunk_bytes // flat.element_size()))
        outs = [self._copy_out(chunks, 0)]
        for i, chunk in enumerate(chunks):
            if i + 1 < len(chunks):
                outs.append(self._copy_out(chunks, i + 1))
            host = self._await_copy_out(outs[i], i, chunk)
            back = self._copy_back(host, chunk, i)
            reduce(host)
        self._finish(back)


def skip_wait(self: StagedAllreduce[Op], event: Op, i: int, chunk: torch.Tensor) -> torch.Tensor:
    """Broken on purpose: hands over the half without waiting for the copy-out."""
    return self.device.host(i % 2, chunk.dtype, chunk.numel())


def skip_after(self: StagedAllreduce[Op], chunks: list[torch.Tensor], j: int) -> Op:
    """Broken on purpose: copies into a half without waiting for the copy-back that last read it."""
    host = self.device.host(j % 2, chunks[j].dtype, chunks[j].numel())
    return self.device.copy_out(chunks[j], host, after=None)


#: name: (how to break the pipeline, the problem the log must show, whether the sum comes out wrong).
BROKEN = {
    "skipped wait for a copy-out": ("_await_copy_out", skip_wait, "reduced before its copy-out ran", True),
    "no wait before overwriting a half": ("_copy_out", skip_after, "overwrote a half", True),
    "no wait for the last copy-back": ("_finish", lambda self, last: None, "returned before the last", True),
    "no overlap": (SerialStaging, None, "(no overlap)", False),
    "copy-back before the reduction": (EarlyCopyBack, None, "copied back before its reduction", False),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_ordering_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demonstration that the ordering test can fail: each deliberately broken pipeline (a step
    monkeypatched to skip its wait, or a test-only variant that reorders the loop) leaves the problem in
    the log that ``test_ordering_holds`` asserts absent, and where a copy now reads memory not yet written
    (the lazy schedule runs copies as late as allowed) the sum is wrong as well."""
    breaker, replacement, problem, wrong_sum = BROKEN[name]
    make: Callable[[RecordingDevice, int], StagedAllreduce[Op]] = StagedAllreduce
    if isinstance(breaker, str):
        monkeypatch.setattr(StagedAllreduce, breaker, replacement)
    else:
        make = breaker
    for outcome in run_pipeline(numel_for(3.5, torch.float32), schedule="lazy", make=make):
        found = ordering_problems(outcome.log, outcome.chunks)
        assert any(problem in p for p in found), found
        assert torch.equal(outcome.got, outcome.want) is not wrong_sum


def test_hooks_see_every_operation_in_order() -> None:
    """The stand-in's hooks see each log entry as it happens: here one asserts, at each reduction, that the
    half being reduced holds what was copied out of that chunk."""
    flat = torch.arange(numel_for(3.5, torch.float32), dtype=torch.float32)
    device = RecordingDevice(CHUNK, "random", seed=3)
    step = CHUNK // 4
    seen: list[tuple[str, int]] = []

    def check(what: str, chunk: int) -> None:
        seen.append((what, chunk))
        if what == "reduce_start":
            part = flat[chunk * step : (chunk + 1) * step]
            assert torch.equal(device.host(chunk % 2, part.dtype, part.numel()), part)

    def rank(comm: Communicator) -> None:
        StagedAllreduce(device, CHUNK)(flat, logging_reduce(comm.allreduce, device, ReduceOp.SUM))

    device.hooks.insert(0, check)  # before the schedule's hook, which logs the copies it runs
    InProcessWorld(1).run(rank)
    assert seen == device.log and ("reduce_start", 3) in seen


def test_chunk_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MPICROSSBOW_STAGE_CHUNK``: bytes or K/M/G, 0 turns the pipeline off, nonsense is refused."""
    monkeypatch.delenv(STAGE_CHUNK_ENV, raising=False)
    assert stage_chunk_bytes() == STAGE_CHUNK_BYTES == 4 << 20
    for text, want in (("65536", 65536), ("16M", 16 << 20), ("512k", 512 << 10), ("0", 0)):
        monkeypatch.setenv(STAGE_CHUNK_ENV, text)
        assert stage_chunk_bytes() == want
    for text in ("lots", "-4M"):
        monkeypatch.setenv(STAGE_CHUNK_ENV, text)
        with pytest.raises(ValueError, match=STAGE_CHUNK_ENV):
            stage_chunk_bytes()


# -- real MPI (and CUDA) -------------------------------------------------------------------------------------

#: The checks the CPU launch reports: the stand-in device with MPICommunicator's and
#: SharedMemoryCommunicator's own host reductions; ``--cuda``: their real CUDA path.
MPI_CHECKS = ("mpi", "mpi+shm")
CUDA_CHECKS = ("cuda-mpi", "cuda-mpi+shm", "cuda-small-and-async")
MPI_CHUNK = 128 << 10  # above the shared-memory path's minimum (64 KB), so its host path sums the chunks


def launch(mpiexec: str, *args: str) -> tuple[dict[str, str], str]:
    proc = run_mpi(mpiexec, 2, [sys.executable, str(HERE), *args], timeout=240)
    tail = f"\n(rc={proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0 and "DONE" in proc.stdout, tail
    return verdicts(proc.stdout), tail


@pytest.mark.mpi
def test_pipeline_over_real_mpi(mpiexec: str) -> None:
    """Two MPI ranks: the pipeline (stand-in device) wired into MPICommunicator sums every dtype and size like
    its plain allreduce, ordered as above; on SharedMemoryCommunicator the chunks go through the
    shared-memory path (the subclass's own host allreduce)."""
    found, tail = launch(mpiexec)
    assert found == {f"staged.{name}": "OK" for name in MPI_CHECKS}, tail


@pytest.mark.mpi
@pytest.mark.cuda
def test_cuda_communicator_under_mpiexec(mpiexec: str) -> None:
    """Two MPI ranks on CUDA tensors (one GPU is enough), MPI without CUDA support: MPICommunicator and
    SharedMemoryCommunicator sum through the real pipeline as the CPU does; a tensor of one chunk takes the
    whole-buffer staging; ``async_op`` returns a completed handle."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    found, tail = launch(mpiexec, "--cuda")
    assert found == {f"staged.{name}": "OK" for name in CUDA_CHECKS}, tail


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pipeline_in_process() -> None:
    """The real CudaStaging (copy streams, events, pinned halves) in this process, two in-process ranks on
    one GPU: every dtype and size gives the plain sum, reused across calls; and the copies wait for a
    kernel still writing the tensor on the current stream (queued behind a ~50 ms sleep)."""
    chunk = 64 << 10
    gpu = torch.device("cuda", 0)

    def rank(comm: Communicator) -> list[str]:
        torch.cuda.set_device(gpu)
        pipeline = StagedAllreduce(CudaStaging(gpu, chunk), chunk)
        wrong = []

        def reduce(host: torch.Tensor) -> None:
            comm.allreduce(host).wait()

        for dtype, chunks in itertools.product(DTYPES, (1, 3.5, 17)):
            flat = values(numel_for(chunks, dtype, chunk), dtype, seed=comm.rank)
            want = flat.clone()
            comm.allreduce(want).wait()
            on_gpu = flat.to(gpu)
            pipeline(on_gpu, reduce)
            if not torch.equal(on_gpu.cpu(), want):
                wrong.append(f"{dtype} x {chunks} chunks")
        late = torch.zeros(numel_for(9.5, torch.float32, chunk), device=gpu)
        torch.cuda._sleep(100_000_000)  # the current stream is busy ...
        late.fill_(comm.rank + 1)  # ... and writes the tensor only after that
        pipeline(late, reduce)
        if not bool((late == 3).all()):
            wrong.append("copied out before the current stream wrote the tensor")
        return wrong

    assert InProcessWorld(2, timeout_s=120).run(rank) == [[], []]


def spy_shared_memory(comm: Any) -> list[object]:
    """A list that grows by one each time the shared-memory communicator's copying path takes a host
    allreduce (it announces each in its window header); always empty for a plain MPICommunicator."""
    taken: list[object] = []
    if hasattr(comm, "_publish"):
        original = comm._publish
        comm._publish = lambda *args: (taken.append(args), original(*args))[1]
    return taken


def check_with_stand_in(comm: Any) -> None:
    """MPICommunicator's ``_staged_allreduce`` on a stand-in device: each dtype and size sums like the plain
    allreduce, in order; SharedMemoryCommunicator's host path is taken where it is one."""
    taken = spy_shared_memory(comm)
    for dtype, chunks in itertools.product(DTYPES, (1.5, 4, 5.25)):
        flat = values(numel_for(chunks, dtype, MPI_CHUNK), dtype, seed=comm.rank)
        want = flat.clone()
        comm.allreduce(want).wait()
        device = RecordingDevice(MPI_CHUNK, "random", seed=comm.rank)
        comm._staging[flat.device] = StagedAllreduce(device, MPI_CHUNK)
        taken.clear()
        reduce = logging_reduce(comm.allreduce, device, ReduceOp.SUM)  # the class's own, bound
        comm.allreduce = lambda host, op, _reduce=reduce: (_reduce(host), DoneHandle())[1]  # logs each chunk
        try:
            comm._staged_allreduce(flat, ReduceOp.SUM)
        finally:
            del comm.allreduce  # the class's again
        device.record("return")
        assert torch.equal(flat, want), f"{dtype}, {chunks} chunks: not the plain sum"
        problems = ordering_problems(device.log, -(-flat.numel() // (MPI_CHUNK // dtype.itemsize)))
        assert not problems, problems
        if hasattr(comm, "_publish") and dtype.is_floating_point:  # it sums floats only
            assert taken, f"{dtype}: no chunk went through the shared-memory path"


def check_cuda(comm: Any) -> None:
    """The communicator's allreduce of CUDA tensors above one chunk goes through its pipeline and gives the
    CPU's plain sum, for every dtype; with shared memory its host path sums the chunks."""
    taken = spy_shared_memory(comm)
    for dtype, chunks in itertools.product(DTYPES, (1.5, 4, 9.25)):
        flat = values(numel_for(chunks, dtype, MPI_CHUNK), dtype, seed=comm.rank)
        on_gpu = flat.cuda()
        comm.allreduce(flat).wait()
        taken.clear()
        comm.allreduce(on_gpu).wait()
        assert torch.equal(on_gpu.cpu(), flat), f"{dtype}, {chunks} chunks: not the CPU's sum"
        assert on_gpu.device in comm._staging, "the pipeline was not used"
        if hasattr(comm, "_publish") and dtype.is_floating_point:  # it sums floats only
            assert taken, f"{dtype}: no chunk went through the shared-memory path"


def check_cuda_small_and_async(comm: Any) -> None:
    """One chunk or less: whole-buffer staging (no pipeline made); ``async_op`` on a larger one: done."""
    small = torch.full((MPI_CHUNK // 4,), 1.0, device="cuda")
    comm.allreduce(small).wait()
    assert not comm._staging and bool((small == 2).all()), "one chunk took the pipeline"
    large = torch.full((3 * MPI_CHUNK // 4,), 1.0, device="cuda")
    handle = comm.allreduce(large, async_op=True)
    assert handle.test() and bool((large == 2).all()), "async_op did not complete before returning"
    assert comm._staging, "the pipeline was not used"


def main() -> int:
    """Rank side: the checks of ``MPI_CHECKS`` (or, with ``--cuda``, ``CUDA_CHECKS``) on 2 ranks."""
    sys.path.insert(0, str(HERE.parent / "mpi_scripts"))
    from verdicts import finish, run_checks, say

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cuda", action="store_true", help="CUDA tensors, the real pipeline")
    args = parser.parse_args()
    os.environ["MPICROSSBOW_CUDA_AWARE"] = "0"  # the staged paths, whatever this MPI says
    os.environ[STAGE_CHUNK_ENV] = str(MPI_CHUNK)  # read by each communicator as it is made
    from mpicrossbow.comm.mpi import MPICommunicator
    from mpicrossbow.comm.shm import SharedMemoryCommunicator

    def on(kind: type[MPICommunicator], check: Callable[[Any], None]) -> Callable[[], None]:
        def run() -> None:
            # a window of one chunk is all the staged sums need, and fits a container's small /dev/shm
            small = {"window_bytes": MPI_CHUNK} if kind is SharedMemoryCommunicator else {}
            comm = kind(**small)
            try:
                check(comm)
            finally:
                comm.close()

        return run

    if args.cuda:
        if not torch.cuda.is_available():
            say("CHECK staged.cuda SKIP no CUDA device")
            return finish(True)
        from mpi4py import MPI

        torch.cuda.set_device(MPI.COMM_WORLD.rank % torch.cuda.device_count())
        checks = [
            ("cuda-mpi", on(MPICommunicator, check_cuda)),
            ("cuda-mpi+shm", on(SharedMemoryCommunicator, check_cuda)),
            ("cuda-small-and-async", on(MPICommunicator, check_cuda_small_and_async)),
        ]
    else:
        checks = [
            ("mpi", on(MPICommunicator, check_with_stand_in)),
            ("mpi+shm", on(SharedMemoryCommunicator, check_with_stand_in)),
        ]
    return finish(run_checks("staged", checks))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent / "mpi_scripts"))
    from verdicts import run_main

    run_main(main)
