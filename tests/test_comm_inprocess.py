"""The in-process world's own behaviour (its Communicator contract is tests/test_communicator_contract.py's):
sums in rank order bit for bit, buffered sends, simulated nodes, results in rank order, and failures that
never hang."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mpicrossbow.comm import Communicator, ReduceOp
from mpicrossbow.testing import InProcessWorld, WorldAborted

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
            comm.allreduce(t, op)
            out.append(t.numpy())
        return out

    results = InProcessWorld(size).run(body)
    for i, numel in enumerate(numels):
        want = rank_data(0, numel, dtype)
        for r in range(1, size):
            want = NP_REDUCE[op](want, rank_data(r, numel, dtype))
        for rank in range(size):
            np.testing.assert_array_equal(results[rank][i], want)


def test_sends_are_buffered() -> None:
    """``isend`` copies the message into the channel at once: its handle is complete before any receive is
    posted, and the sender's tensor may change straight away."""

    def body(comm: Communicator) -> float:
        out = torch.tensor([comm.rank + 0.5])
        assert comm.isend(out, (comm.rank + 1) % comm.size, tag=1).test()
        out.fill_(-1.0)
        into = torch.zeros(1)
        comm.irecv(into, (comm.rank - 1) % comm.size, tag=1).wait()
        return into.item()

    assert InProcessWorld(3).run(body) == [2.5, 0.5, 1.5]


def test_split_node_groups_the_simulated_nodes() -> None:
    """With ``ranks_per_node=2`` ranks 0-1 and 2-3 form the nodes: ``split_node`` ranks, sizes and sums."""

    def body(comm: Communicator) -> tuple[int, int, float]:
        node = comm.split_node()
        t = torch.tensor([float(comm.rank)])
        node.allreduce(t)
        return node.rank, node.size, t.item()

    assert InProcessWorld(4, ranks_per_node=2).run(body) == [
        (0, 2, 1.0),
        (1, 2, 1.0),
        (0, 2, 5.0),
        (1, 2, 5.0),
    ]


def test_results_come_back_in_rank_order() -> None:
    assert InProcessWorld(4).run(lambda comm: comm.rank * 10) == [0, 10, 20, 30]


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
