"""Checks of MPICommunicator and TorchDistCommunicator(gloo) under a real ``mpiexec``, one launch for all.

Rank 0 prints ``CHECK <backend>.<name> OK|SKIP <why>|FAIL <rank: why; ...>`` per check, then ``DONE``, for
tests/test_comm_mpi.py to assert on. Data are small integers, exact in every dtype, so any summation order
gives the reference. ``--cuda`` runs the checks on CUDA tensors: MPI staged through pinned memory, MPI
CUDA-aware when the library says so, and NCCL when every rank has its own GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
from mpi4py import MPI
from verdicts import WORLD, finish, run_checks, run_main, say

from mpicrossbow.comm import ReduceOp, make_communicator
from mpicrossbow.comm.base import Communicator
from mpicrossbow.comm.mpi import MPICommunicator, mpi_cuda_aware
from mpicrossbow.comm.torchdist import TorchDistCommunicator
from mpicrossbow.config import CommSection

N = 100_003  # not a multiple of any world size
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.float16, torch.bfloat16)
NP_OPS = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.MIN: np.min}
Check = Callable[[Communicator, torch.device], None]


def data(
    rank: int, numel: int, dtype: torch.dtype = torch.float32, dev: torch.device | str = "cpu"
) -> torch.Tensor:
    """Rank-specific integers in 0..16: exact in every dtype, sums exact up to 15 ranks even in bfloat16."""
    return ((torch.arange(numel) * (rank + 1) + 3 * rank) % 17).to(dtype=dtype, device=dev)


def ref(ranks: Iterable[int], numel: int, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """What reducing the data of ``ranks`` must give (one rank: what it sent)."""
    return NP_OPS[op](np.stack([data(r, numel, torch.int64).numpy() for r in ranks]), axis=0)


def expect(tensor: torch.Tensor, want: np.ndarray, what: str) -> None:
    got = tensor.cpu().to(torch.int64).numpy()
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)[:3]
        raise AssertionError(f"{what}: at {bad.tolist()} got {got[bad].tolist()} want {want[bad].tolist()}")


def raises(error: type[Exception], fn: Callable[[], object], what: str) -> None:
    try:
        fn()
    except error:
        return
    raise AssertionError(f"{what} did not raise {error.__name__}")


def check_allreduce(c: Communicator, dev: torch.device) -> None:
    cases = [(ReduceOp.SUM, dtype, numel) for dtype in DTYPES for numel in (1, 7, 1000, N)]
    cases += [
        (op, dtype, 1000)
        for op in (ReduceOp.MAX, ReduceOp.MIN)
        for dtype in (torch.float32, torch.int32, torch.bfloat16)
    ]
    for op, dtype, numel in cases:
        t = data(c.rank, numel, dtype, dev)
        assert c.allreduce(t, op).test()
        expect(t, ref(range(c.size), numel, op), f"{op} {dtype} x {numel}")


def check_async_allreduce(c: Communicator, dev: torch.device) -> None:
    ts = [data(c.rank, N, dtype, dev) for dtype in (torch.float32, torch.bfloat16, torch.int64)]
    handles = [c.allreduce(t, async_op=True) for t in ts]
    for t, h in zip(ts, handles, strict=True):
        h.wait()
        assert h.test(), "test() is False after wait()"
        expect(t, ref(range(c.size), N), f"async {t.dtype}")


def check_broadcast(c: Communicator, dev: torch.device) -> None:
    root = c.size - 1
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        t = data(c.rank, 1000, dtype, dev)
        c.broadcast(t, root)
        expect(t, ref([root], 1000), f"broadcast {dtype}")
    t = data(c.rank, N, torch.float16, dev)
    c.broadcast(t, root, async_op=True).wait()
    expect(t, ref([root], N), "async broadcast float16")


def check_ring(c: Communicator, dev: torch.device) -> None:
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    for dtype in (torch.float32, torch.bfloat16):
        into = torch.zeros(N, dtype=dtype, device=dev)
        recv, send = c.irecv(into, left, tag=7), c.isend(data(c.rank, N, dtype, dev), right, tag=7)
        recv.wait()
        send.wait()
        expect(into, ref([left], N), f"ring {dtype}")


def check_tags(c: Communicator, dev: torch.device) -> None:
    """Tags 1 then 2 are sent; the receives are posted tag 2 first."""
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    sends = [c.isend(data(c.rank + tag, 1000, dev=dev), right, tag=tag) for tag in (1, 2)]
    second, first = torch.zeros(1000, device=dev), torch.zeros(1000, device=dev)
    for h in [c.irecv(second, left, tag=2), c.irecv(first, left, tag=1), *sends]:
        h.wait()
    expect(first, ref([left + 1], 1000), "tag 1")
    expect(second, ref([left + 2], 1000), "tag 2")


def check_barrier(c: Communicator, dev: torch.device) -> None:
    time.sleep(0.05 * c.rank)
    entered = time.time()
    c.barrier()
    times = WORLD.allgather((entered, time.time()))
    last_in, first_out = max(t[0] for t in times), min(t[1] for t in times)
    assert first_out >= last_in, f"a rank left the barrier {last_in - first_out:.3f}s before the last entered"


def check_split(c: Communicator, dev: torch.device) -> None:
    sub = c.split(c.rank % 2, key=-c.rank)  # evens and odds, each in reverse rank order
    members = sorted((r for r in range(c.size) if r % 2 == c.rank % 2), reverse=True)
    assert (sub.rank, sub.size) == (members.index(c.rank), len(members)), f"got {sub!r}"
    t = data(c.rank, 1000, dev=dev)
    sub.allreduce(t)
    expect(t, ref(members, 1000), "split allreduce")
    t = data(c.rank, 1000, dev=dev)
    sub.broadcast(t, root=0)
    expect(t, ref(members[:1], 1000), "split broadcast from the key-first rank")
    if sub.size > 1:  # (Gloo cannot send to itself)
        right, left = (sub.rank + 1) % sub.size, (sub.rank - 1) % sub.size
        into = torch.zeros(1000, device=dev)
        recv = sub.irecv(into, left, tag=3)
        sub.isend(data(c.rank, 1000, dev=dev), right, tag=3).wait()
        recv.wait()
        expect(into, ref([members[left]], 1000), "split ring")
    nested = sub.split(0, key=sub.size - sub.rank)  # a split of a split: same members, order reversed again
    t = torch.full((3,), float(c.rank), device=dev)
    nested.allreduce(t)
    assert nested.rank == members[::-1].index(c.rank), f"nested split gave {nested!r}"
    assert t.tolist() == [float(sum(members))] * 3, f"nested split allreduce gave {t.tolist()}"
    sub.close()
    sub.close()  # idempotent, and closes the nested split too


def check_split_node(c: Communicator, dev: torch.device) -> None:
    node = c.split_node()  # every rank of a one-machine job shares the node, in rank order
    assert (node.rank, node.size) == (c.rank, c.size), f"got {node!r}"
    t = data(c.rank, 1000, dev=dev)
    node.allreduce(t)
    expect(t, ref(list(range(c.size)), 1000), "split_node allreduce")
    node.close()


def check_zero_copy(c: Communicator, dev: torch.device) -> None:
    t = data(c.rank, N, dev=dev)
    ptr, window = t.data_ptr(), t[10:20]  # a view taken before: it must see the result
    c.allreduce(t)
    assert t.data_ptr() == ptr, "allreduce replaced the tensor's storage"
    expect(window, ref(range(c.size), N)[10:20], "view into the reduced storage")


def check_scalars(c: Communicator, dev: torch.device) -> None:
    got = c.allreduce_scalars([float(c.rank), 1.0])
    assert got == [float(sum(range(c.size))), float(c.size)], got


def check_non_contiguous(c: Communicator, dev: torch.device) -> None:
    raises(ValueError, lambda: c.allreduce(torch.zeros(4, 4, device=dev).t()), "a transposed tensor")


class SpyComm:
    """Forwards to a real mpi4py communicator and records the address of each buffer handed to MPI."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm, self.addresses = comm, []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.comm, name)

        def call(*args: object) -> object:
            self.addresses.append((args[1] if args[0] is MPI.IN_PLACE else args[0]).ctypes.data)
            return attr(*args)

        return call if name in ("Allreduce", "Iallreduce", "Bcast", "Ibcast", "Isend", "Irecv") else attr


def check_mpi_buffers(c: Communicator, dev: torch.device) -> None:
    """MPI is handed the tensor's own memory (no copy) by every operation."""
    spy = SpyComm(WORLD)
    comm = MPICommunicator(spy)  # type: ignore[arg-type]
    t, out = data(c.rank, 1000), data(c.rank, 1000)
    comm.allreduce(t)
    comm.allreduce(t, async_op=True).wait()
    comm.broadcast(t, 0)
    h = comm.irecv(t, (c.rank - 1) % c.size)
    comm.isend(out, (c.rank + 1) % c.size).wait()
    h.wait()
    assert spy.addresses == [t.data_ptr()] * 4 + [out.data_ptr()], "MPI got a copy, not the tensor's memory"


def check_factory(c: Communicator, dev: torch.device) -> None:
    assert isinstance(make_communicator(CommSection(), torch.device("cpu")), MPICommunicator)
    if not torch.cuda.is_available():
        raises(ValueError, lambda: TorchDistCommunicator.from_mpi(backend="nccl"), "nccl without CUDA")
    for value, want in (("0", False), ("1", True)):
        os.environ["MPICROSSBOW_CUDA_AWARE"] = value
        assert mpi_cuda_aware() is want, f"MPICROSSBOW_CUDA_AWARE={value} ignored"
    del os.environ["MPICROSSBOW_CUDA_AWARE"]


COMMON_NAMES = (
    "allreduce async_allreduce broadcast ring tags barrier split split_node zero_copy scalars non_contiguous"
)
COMMON: list[tuple[str, Check]] = [(name, globals()[f"check_{name}"]) for name in COMMON_NAMES.split()]


def on(comm: Communicator, dev: torch.device, checks: list[tuple[str, Check]]) -> list[tuple[str, Callable]]:
    """The checks bound to one communicator and device, for :func:`verdicts.run_checks`."""
    return [(name, functools.partial(fn, comm, dev)) for name, fn in checks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cuda", action="store_true", help="check CUDA tensors instead of CPU tensors")
    args = parser.parse_args()
    ok = True
    if not args.cuda:
        cpu = torch.device("cpu")
        extra = [("buffers", check_mpi_buffers), ("factory", check_factory)]
        ok &= run_checks("mpi", on(MPICommunicator(), cpu, [*COMMON, *extra]))
        gloo = TorchDistCommunicator.from_mpi(backend="gloo", timeout_s=60)
        ok &= run_checks("gloo", on(gloo, cpu, COMMON))
        gloo.close()
        gloo.close()  # idempotent
    elif not torch.cuda.is_available():
        say("CHECK cuda SKIP no CUDA device")
    else:
        local = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        dev = torch.device("cuda", local.Get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        gpu_checks = [(n, f) for n, f in COMMON if n != "barrier"]
        os.environ["MPICROSSBOW_CUDA_AWARE"] = "0"
        ok &= run_checks("mpi-staged", on(MPICommunicator(), dev, gpu_checks))
        del os.environ["MPICROSSBOW_CUDA_AWARE"]
        if mpi_cuda_aware():
            ok &= run_checks("mpi-cuda-aware", on(MPICommunicator(), dev, gpu_checks))
        else:
            say("CHECK mpi-cuda-aware SKIP this MPI does not report CUDA support")
        if local.allreduce(1) <= torch.cuda.device_count():
            nccl = TorchDistCommunicator.from_mpi(backend="nccl", timeout_s=60)
            ok &= run_checks("nccl", on(nccl, dev, [(n, f) for n, f in gpu_checks if n != "tags"]))
            nccl.close()
        else:
            say("CHECK nccl SKIP fewer GPUs than ranks on a node")
    return finish(ok)


if __name__ == "__main__":
    run_main(main)
