"""The in-process world: exact collectives, MPI-like matching, splits, and failures that never hang."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mpicrossbow.comm import Communicator, InProcessWorld, ReduceOp, WorldAborted

SIZES = [1, 2, 3, 4]
NP_REDUCE = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}


def rank_data(rank: int, numel: int, dtype: np.dtype) -> np.ndarray:
    """Random, rank-specific values (not integers: order of summation matters)."""
    return np.random.default_rng(100 + rank).standard_normal(numel).astype(dtype)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_allreduce_matches_numpy_in_rank_order(size: int, op: ReduceOp, dtype: np.dtype) -> None:
    """Bit-exact against numpy reducing rank 0, 1, …, n-1 in order, for sizes not a multiple of the world."""
    numels = (1, 5, 1003)

    def body(comm: Communicator) -> list[np.ndarray]:
        out = []
        for numel in numels:
            t = torch.from_numpy(rank_data(comm.rank, numel, dtype))
            assert comm.allreduce(t, op).test()
            out.append(t.numpy())
        return out

    results = InProcessWorld(size).run(body)
    for i, numel in enumerate(numels):
        want = rank_data(0, numel, dtype)
        for r in range(1, size):
            want = NP_REDUCE[op](want, rank_data(r, numel, dtype))
        for rank in range(size):
            np.testing.assert_array_equal(results[rank][i], want)


def test_bfloat16_accumulates_in_float32() -> None:
    """Half-precision sums are taken in float32 and rounded once, like the MPI backend."""
    values = [1.0, 2.0**-8, 2.0**-8]  # in bfloat16, 1 + 2^-8 rounds back to 1 at every step

    def body(comm: Communicator) -> float:
        t = torch.tensor([values[comm.rank]], dtype=torch.bfloat16)
        comm.allreduce(t, async_op=True).wait()
        return t.item()

    assert InProcessWorld(3).run(body) == [1 + 2.0**-7] * 3


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_from_last_rank(size: int) -> None:
    def body(comm: Communicator) -> list[float]:
        t = torch.full((7,), float(comm.rank))
        comm.broadcast(t, root=comm.size - 1)
        return t.tolist()

    assert InProcessWorld(size).run(body) == [[float(size - 1)] * 7] * size


@pytest.mark.parametrize("size", SIZES)
def test_ring_and_out_of_order_tags(size: int) -> None:
    """Each rank sends tags 1 then 2 to its right; receives are posted tag 2 first and still match."""

    def body(comm: Communicator) -> tuple[float, float]:
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        for tag in (1, 2):
            assert comm.isend(torch.tensor([comm.rank + tag / 10]), right, tag=tag).test()
        two, one = torch.zeros(1), torch.zeros(1)
        h2, h1 = comm.irecv(two, left, tag=2), comm.irecv(one, left, tag=1)
        h1.wait()
        h2.wait()
        return one.item(), two.item()

    got = InProcessWorld(size).run(body)
    want = [((r - 1) % size + 0.1, (r - 1) % size + 0.2) for r in range(size)]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6)


def test_messages_on_one_channel_are_fifo_and_test_does_not_block() -> None:
    def body(comm: Communicator) -> list[float]:
        if comm.rank == 1:
            comm.barrier()  # rank 0 has posted and tested its receives
            for value in (10.0, 20.0):
                comm.isend(torch.tensor([value]), 0, tag=5)
            return []
        first, second = torch.zeros(1), torch.zeros(1)
        h1, h2 = comm.irecv(first, 1, tag=5), comm.irecv(second, 1, tag=5)
        assert not h1.test() and not h2.test()
        comm.barrier()
        h2.wait()  # bound to the second message, whatever the order of waits
        h1.wait()
        assert h1.test()
        return [first.item(), second.item()]

    assert InProcessWorld(2).run(body)[0] == [10.0, 20.0]


@pytest.mark.parametrize("size", SIZES)
def test_split_into_evens_and_odds(size: int) -> None:
    """Sub-worlds by color, ordered by key (here reversed rank); collectives stay inside each."""

    def body(comm: Communicator) -> tuple[int, int, float, float]:
        sub = comm.split(comm.rank % 2, key=-comm.rank)
        t = torch.tensor([float(comm.rank)])
        sub.allreduce(t)
        first = torch.tensor([float(comm.rank)])
        sub.broadcast(first, root=0)
        return sub.rank, sub.size, t.item(), first.item()

    for rank, (sub_rank, sub_size, total, first) in enumerate(InProcessWorld(size).run(body)):
        members = sorted((r for r in range(size) if r % 2 == rank % 2), reverse=True)
        assert (sub_rank, sub_size) == (members.index(rank), len(members))
        assert total == sum(members) and first == members[0]


def test_results_come_back_in_rank_order() -> None:
    assert InProcessWorld(4).run(lambda comm: comm.rank * 10) == [0, 10, 20, 30]


def test_barrier_waits_for_the_last_rank() -> None:
    def body(comm: Communicator) -> tuple[float, float]:
        time.sleep(0.05 * comm.rank)
        entered = time.monotonic()
        comm.barrier()
        return entered, time.monotonic()

    times = InProcessWorld(3).run(body)
    assert min(t[1] for t in times) >= max(t[0] for t in times)


@pytest.mark.parametrize("waiting_in", ["allreduce", "irecv", "barrier"])
def test_one_rank_failing_ends_the_world_quickly(waiting_in: str) -> None:
    """The error is re-raised naming its rank; the others leave their waits with WorldAborted, not a hang."""
    aborted: list[int] = []

    def body(comm: Communicator) -> None:
        if comm.rank == 2:
            time.sleep(0.1)
            raise ValueError("boom")
        try:
            if waiting_in == "allreduce":
                comm.allreduce(torch.zeros(3))
            elif waiting_in == "irecv":
                comm.irecv(torch.zeros(3), 2).wait()
            else:
                comm.barrier()
        except WorldAborted:
            aborted.append(comm.rank)
            raise

    start = time.monotonic()
    with pytest.raises(ValueError, match="boom") as info:
        InProcessWorld(4, timeout_s=30).run(body)
    assert time.monotonic() - start < 5
    assert any("rank 2" in note for note in getattr(info.value, "__notes__", [])), info.value
    assert sorted(aborted) == [0, 1, 3]


def test_recv_without_sender_times_out() -> None:
    def body(comm: Communicator) -> None:
        comm.irecv(torch.zeros(1), src=0, tag=9).wait()

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"irecv\(src=0, tag=9\) on rank 0"):
        InProcessWorld(1, timeout_s=0.3).run(body)
    assert time.monotonic() - start < 3


def test_mismatched_shapes_and_bad_sizes_are_errors() -> None:
    with pytest.raises(ValueError, match="different shapes"):
        InProcessWorld(2).run(lambda comm: comm.allreduce(torch.zeros(comm.rank + 1)))
    with pytest.raises(ValueError, match="at least 1"):
        InProcessWorld(0)
