"""``[comm] compression`` over real MPI (``mpiexec -n 2``), one launch for every check.

Rank 0 prints ``CHECK <wire>.<name> OK|FAIL <rank: why; ...>`` per check, then ``DONE``, for
tests/test_compression_mpi.py to assert on. Expectations are computed from the inputs: each rank's float32
values rounded to the wire type, summed in float32 (two operands: the order does not matter) and rounded once.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable

import torch
from verdicts import WORLD, finish, run_checks, run_main

from mpicrossbow.comm import CompressedCommunicator, ReduceOp, make_communicator
from mpicrossbow.comm.compressed import EXACT_TAIL
from mpicrossbow.comm.mpi import MPICommunicator
from mpicrossbow.config import CommSection

N = 100_003  # a rendezvous-size message, not a multiple of the world size


def values(rank: int, numel: int = N) -> torch.Tensor:
    """Rank-specific values with bits below 16-bit precision."""
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(numel, generator=generator, dtype=torch.float64).float()


def rounded(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    return t.to(wire).float()


def check_allreduce(c: CompressedCommunicator) -> None:
    want = rounded(rounded(values(0), c.wire) + rounded(values(1), c.wire), c.wire)
    t = values(c.rank)
    c.allreduce(t).wait()
    assert torch.equal(t, want), "blocking allreduce differs from the rounded float32 sum"
    a = values(c.rank)
    handle = c.allreduce(a, async_op=True)
    handle.wait()
    assert torch.equal(a, want), "async allreduce differs from the rounded float32 sum"
    m = values(c.rank)
    c.allreduce(m, ReduceOp.MAX).wait()
    assert torch.equal(m, torch.maximum(rounded(values(0), c.wire), rounded(values(1), c.wire)))


def check_broadcast(c: CompressedCommunicator) -> None:
    for root in (0, 1):
        t = values(c.rank)
        c.broadcast(t, root).wait()
        assert torch.equal(t, rounded(values(root), c.wire)), f"broadcast from {root}"


def check_point_to_point(c: CompressedCommunicator) -> None:
    """isend of a temporary, collected before the peer even posts its receive: the handle keeps the copy."""
    peer = 1 - c.rank
    into = torch.zeros(N)
    if c.rank == 0:
        send = c.isend(values(0), peer, tag=3)
        gc.collect()
        WORLD.Barrier()
        recv = c.irecv(into, peer, tag=4)
    else:
        WORLD.Barrier()
        recv = c.irecv(into, peer, tag=3)
        send = c.isend(values(1), peer, tag=4)
    assert torch.equal(into, torch.zeros(N)) or recv.test()  # widened only once complete
    recv.wait()
    send.wait()
    want = rounded(values(peer), c.wire)
    want[-EXACT_TAIL:] = values(peer)[-EXACT_TAIL:]  # a message's last values travel bit-exact
    assert torch.equal(into, want), "received values are not the rounded ones with an exact tail"


def check_exact_paths(c: CompressedCommunicator) -> None:
    """Metrics, flags, integers and small tensors are never rounded; ``exact`` is the MPI communicator."""
    fine = 1 + 2.0**-30
    assert c.allreduce_scalars([fine, 1.0]) == [2 * fine, 2.0]
    flag = torch.tensor([fine * (c.rank + 1)], dtype=torch.float64)
    c.allreduce(flag, ReduceOp.MAX, async_op=True).wait()
    assert flag.item() == 2 * fine
    small = torch.full((1000,), fine)
    c.allreduce(small).wait()
    assert torch.equal(small, torch.full((1000,), 2 * fine))
    ints = torch.arange(N, dtype=torch.int64) * (2**40 + c.rank)
    c.allreduce(ints).wait()
    assert torch.equal(ints, torch.arange(N, dtype=torch.int64) * (2**41 + 1))
    assert isinstance(c.exact, MPICommunicator)
    e = values(c.rank)
    c.exact.allreduce(e).wait()
    assert torch.equal(e, values(0) + values(1)), "the exact communicator rounded"


def check_split(c: CompressedCommunicator) -> None:
    node = c.split_node()
    assert isinstance(node, CompressedCommunicator) and node.size == 2
    t = values(c.rank)
    node.allreduce(t).wait()
    assert torch.equal(t, rounded(rounded(values(0), c.wire) + rounded(values(1), c.wire), c.wire))


CHECKS: list[tuple[str, Callable[[CompressedCommunicator], None]]] = [
    ("allreduce", check_allreduce),
    ("broadcast", check_broadcast),
    ("point_to_point", check_point_to_point),
    ("exact_paths", check_exact_paths),
    ("split", check_split),
]


def main() -> int:
    assert WORLD.size == 2, "run with mpiexec -n 2"
    ok = True
    for name in ("bf16", "fp16"):
        comm = make_communicator(CommSection(backend="mpi", compression=name), torch.device("cpu"))
        assert isinstance(comm, CompressedCommunicator)
        ok &= run_checks(name, [(check, functools.partial(fn, comm)) for check, fn in CHECKS])
        comm.close()
    return finish(ok)


if __name__ == "__main__":
    run_main(main)
