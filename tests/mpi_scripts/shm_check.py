"""SharedMemoryCommunicator's own behaviour under a real ``mpiexec``, beyond the Communicator contract
(tests/test_communicator_contract.py, which also runs it with its default thresholds).

Data are random floats (seeded per rank and case), so a different summation order gives different bits: the
result must equal the documented order exactly — per node ``((x_0 + x_1) + x_2) + ...`` in node-rank order in
the accumulation dtype, node sums added in node order — be close to the float64 sum, and be the same bits on
every rank; through chunked windows, fake multi-node splits and window-backed buffers. ``CHECKS`` runs in the
contract's launch (``--also shm_check``; this module is imported before any window exists, so
:data:`BEFORE` holds only MPI's own segments); tests/test_comm_shm.py asserts the verdicts and the ``SEGMENT``
lines. Run as a script with ``--fail``, the last rank raises once a window is in use, and the job ends as the
launcher ends it, with ``MPI_Abort``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Callable, Iterator

import numpy as np
import torch
from verdicts import WORLD, run_main, say

from mpicrossbow.comm import make_communicator
from mpicrossbow.comm.mpi import MPICommunicator
from mpicrossbow.comm.shm import ACCUMULATE, SharedMemoryCommunicator
from mpicrossbow.config import CommSection

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SIZES = (1, 7, 1001, 100_003)  # none a multiple of 2, 3 or 4 (except 1 with 1 rank)
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def data(rank: int, numel: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    """Rank- and case-specific random floats in [-1, 1)."""
    gen = torch.Generator().manual_seed(1000 * case + rank)
    return (torch.rand(numel, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)


def reference(nodes: list[list[int]], numel: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    """The documented order: each node's ranks summed in order, node sums added in order, rounded once."""
    acc = ACCUMULATE[dtype]
    total: torch.Tensor | None = None
    for members in nodes:
        node_sum = data(members[0], numel, dtype, case).to(acc)
        for r in members[1:]:
            node_sum = node_sum + data(r, numel, dtype, case).to(acc)
        total = node_sum if total is None else total + node_sum
    assert total is not None
    return total.to(dtype)


def exact_sum(numel: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    return sum(data(r, numel, dtype, case).double() for r in range(WORLD.size))  # type: ignore[return-value]


def assert_sums(comm: SharedMemoryCommunicator, nodes: list[list[int]], exact_order: bool, tag: int) -> None:
    """Every dtype and size, default chunking and tiny chunks, sync and async; results equal on all ranks."""
    case = tag
    for dtype in DTYPES:
        for numel in SIZES:
            for async_op in (False, True):
                case += 1
                t = data(WORLD.rank, numel, dtype, case)
                handle = comm.allreduce(t, async_op=async_op)
                handle.wait()
                assert handle.test()
                what = f"{dtype} x {numel} async={async_op} nodes={nodes}"
                if exact_order:
                    want = reference(nodes, numel, dtype, case)
                    assert torch.equal(t, want), f"{what}: differs from the documented order"
                close = (t.double() - exact_sum(numel, dtype, case)).abs().max().item()
                assert close <= TOLERANCE[dtype] * WORLD.size, f"{what}: off the float64 sum by {close}"
                digest = hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()
                assert len(set(WORLD.allgather(digest))) == 1, f"{what}: ranks disagree"


def mapped_segments() -> set[str]:
    """The /dev/shm files this process has mapped (``path`` or ``path (deleted)``)."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        fields = (line.split(None, 5) for line in maps)
        return {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/dev/shm/")}


BEFORE = mapped_segments() if os.path.exists("/proc/self/maps") else set()


def report_segments() -> None:
    """Rank 0 prints ``SEGMENT mpi|window <path>``: what the job mapped before any window and since
    (collective)."""
    now = mapped_segments() if os.path.exists("/proc/self/maps") else set()
    for kind, paths in (("mpi", BEFORE), ("window", now - BEFORE)):
        for path in sorted(set().union(*WORLD.allgather(sorted(paths)))):
            say(f"SEGMENT {kind} {path}")


def check_one_node() -> None:
    comm = SharedMemoryCommunicator(WORLD, min_bytes=0)
    assert comm.nodes == 1 and comm.node_size == WORLD.size, f"{comm.nodes} node(s) of {comm.node_size}"
    assert_sums(comm, [list(range(WORLD.size))], True, 0)
    comm.close()
    comm.close()  # idempotent


def check_chunks() -> None:
    """A 4 KB window: 100_003 float32 go in 98 chunks (and bf16 accumulators in twice the slot's bytes)."""
    comm = SharedMemoryCommunicator(WORLD, window_bytes=4096, min_bytes=0)
    assert_sums(comm, [list(range(WORLD.size))], True, 10_000)
    comm.close()


def check_two_nodes() -> None:
    """The world split into two fake nodes (first half, second half): leader allreduce + node broadcast."""
    half = WORLD.size // 2
    node = WORLD.Split(int(WORLD.rank >= half), key=WORLD.rank)
    comm = SharedMemoryCommunicator(WORLD, node=node, window_bytes=8192, min_bytes=0)
    nodes = [m for m in (list(range(half)), list(range(half, WORLD.size))) if m]
    assert comm.nodes == min(2, WORLD.size), f"{comm.nodes} nodes"
    assert_sums(comm, nodes, True, 20_000)
    comm.close()
    node.Free()


def check_every_rank_a_node() -> None:
    """One fake node per rank: the whole sum is MPI's among leaders (its order: compared closely)."""
    node = WORLD.Split(WORLD.rank, key=0)
    comm = SharedMemoryCommunicator(WORLD, node=node, min_bytes=0)
    assert comm.nodes == WORLD.size and comm.node_size == 1
    assert_sums(comm, [[r] for r in range(WORLD.size)], WORLD.size <= 2, 30_000)
    comm.close()
    node.Free()


def one_node_then_two() -> Iterator[tuple[SharedMemoryCommunicator, list[list[int]]]]:
    """A communicator over the whole job as one node, then one over a fake split into two nodes, each with
    its nodes' ranks; each is closed when the loop moves on."""
    half = WORLD.size // 2
    node = WORLD.Split(int(WORLD.rank >= half), key=WORLD.rank)
    for comm, nodes in (
        (SharedMemoryCommunicator(WORLD, min_bytes=0), [list(range(WORLD.size))]),
        (
            SharedMemoryCommunicator(WORLD, node=node, min_bytes=0),
            [m for m in (list(range(half)), list(range(half, WORLD.size))) if m],
        ),
    ):
        yield comm, nodes
        comm.close()
    node.Free()


def check_shared_buffer() -> None:
    """Window-backed buffers: zero-copy on one node (whole buffer and a slice at the same offset), and across
    fake nodes (in place; the copying path for 16-bit dtypes); equal to the documented order either way."""
    for comm, nodes in one_node_then_two():
        case = 40_000
        for dtype in DTYPES:
            buf = comm.shared_buffer(100_003, dtype)
            assert buf.eq(0).all() and buf.dtype == dtype and buf.numel() == 100_003
            for lo, hi in ((0, 100_003), (5, 1006), (99_000, 100_003)):
                case += 1
                buf[lo:hi] = data(WORLD.rank, hi - lo, dtype, case)
                ptr = buf.data_ptr()
                comm.allreduce(buf[lo:hi], async_op=True).wait()
                assert buf.data_ptr() == ptr
                want = reference(nodes, hi - lo, dtype, case)
                assert torch.equal(buf[lo:hi], want), f"shared {dtype} [{lo}:{hi}] nodes={nodes}"
        report_segments()


def check_share() -> None:
    """Tensors moved into shared memory in place (``share``), as the pool's flat buffers are: every view
    follows the move and sees the sums; the whole tensor and slices at one offset sum in the documented order
    on one node and across fake nodes (leaders in place, the others copying their leader's); a tensor that
    is dropped leaves no entry that memory reused later could be mistaken for; a mean (BSP's step) divides
    in the tiles, as the first call of a fresh communicator too."""
    fresh = SharedMemoryCommunicator(WORLD, min_bytes=0)
    first = data(WORLD.rank, 1001, torch.float32, 49_999)
    fresh.share(first)
    fresh.allreduce_mean(first, 2 * WORLD.size)
    want = reference([list(range(WORLD.size))], 1001, torch.float32, 49_999) / (2 * WORLD.size)
    assert torch.equal(first, want), "mean of a shared tensor as the first call"
    fresh.close()
    for comm, nodes in one_node_then_two():
        case = 50_000
        for dtype in DTYPES:
            flat = torch.from_numpy(np.zeros(100_003, dtype=np.float64)).to(dtype)
            view = flat[5:1006]  # as a module parameter is a view of the pool's flat buffer
            comm.share(flat)
            assert flat.untyped_storage().is_shared() or WORLD.size == 1
            assert view.data_ptr() == flat.data_ptr() + 5 * flat.element_size(), "a view lost the buffer"
            for lo, hi in ((0, 100_003), (5, 1006), (99_000, 100_003)):
                case += 1
                flat[lo:hi] = data(WORLD.rank, hi - lo, dtype, case)
                comm.allreduce(flat[lo:hi]).wait()
                want = reference(nodes, hi - lo, dtype, case)
                assert torch.equal(flat[lo:hi], want), f"shared {dtype} [{lo}:{hi}] nodes={nodes}"
            assert torch.equal(view, flat[5:1006])
            del flat, view
            fresh = data(WORLD.rank, 100_003, dtype, case + 1)  # may reuse the freed address
            comm.allreduce(fresh)
            assert torch.equal(fresh, reference(nodes, 100_003, dtype, case + 1)), f"after drop {dtype}"
        report_segments()


def check_mismatch() -> None:
    """Ranks allreducing different sizes, or a shared buffer at different offsets, all get one ValueError,
    and the next allreduce works."""
    comm = SharedMemoryCommunicator(WORLD, min_bytes=0)
    buf = comm.shared_buffer(10_000)
    for make in (
        lambda: torch.ones(1000 + (WORLD.rank == WORLD.size - 1)),
        lambda: buf[(WORLD.rank == WORLD.size - 1) : 1000],
        lambda: buf[:1000] if WORLD.rank else torch.ones(1000),
    ):
        try:
            comm.allreduce(make())
            raised = ""
        except ValueError as exc:
            raised = str(exc)
        if WORLD.size > 1:
            assert "different buffers" in raised, f"no error: {raised!r}"
        t = torch.ones(5000)
        comm.allreduce(t)
        assert t.eq(WORLD.size).all(), "the allreduce after a mismatch is wrong"
    comm.close()


def check_factory() -> None:
    """``auto`` takes the shared-memory path exactly when a node holds more than one rank."""
    comm = make_communicator(CommSection(backend="mpi"), "cpu")
    assert isinstance(comm, SharedMemoryCommunicator) == (WORLD.size > 1), type(comm).__name__
    comm.close()
    off = make_communicator(CommSection(shared_memory="off"), "cpu")
    assert type(off) is MPICommunicator
    on = make_communicator(
        CommSection(backend="mpi", shared_memory="on", shm_window_mb=1 / 16, shm_min_kb=0), "cpu"
    )
    assert isinstance(on, SharedMemoryCommunicator) and on.window_bytes == 1 << 16
    on.close()


CHECKS: list[tuple[str, Callable[[], None]]] = [
    (name, globals()[f"check_{name}"])
    for name in (
        "one_node",
        "chunks",
        "two_nodes",
        "every_rank_a_node",
        "shared_buffer",
        "share",
        "mismatch",
        "factory",
    )
]


def main() -> int:
    """``--fail``: the last rank raises once the window is in use; the others wait in an allreduce."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fail", action="store_true", required=True, help="the last rank raises")
    parser.parse_args()
    comm = SharedMemoryCommunicator(WORLD, min_bytes=0)
    t = torch.ones(1000)
    comm.allreduce(t)
    comm.shared_buffer(1000)
    moved = torch.ones(100_000)
    comm.share(moved)
    comm.allreduce(moved)
    report_segments()
    if WORLD.rank == WORLD.size - 1:
        raise RuntimeError("injected failure with the window allocated")
    comm.allreduce(t)  # the others wait here until MPI_Abort ends them
    return 0


if __name__ == "__main__":
    run_main(main)
