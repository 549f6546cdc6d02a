"""BSP against references: gradient mode equals one process on the union of the ranks' batches, with the
bucketed, overlapped allreduce (``bucket_mb`` > 0) bitwise equal to the one-allreduce path
(``bucket_mb = 0``); parameter mode equals its numpy reference (tests/reference.py: local steps, then the
mean). World sizes 1, 2 and 4 run in-process, and the buckets also under mpiexec -n 2 and -n 4."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import reference
from conftest import launcher, only_run, run_mpi, run_world
from models.mlp import MLP
from mpicrossbow.comm.compressed import CompressedCommunicator
from mpicrossbow.config import OptimSection
from mpicrossbow.pool import FusedPool, SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.reporting.metrics import read_metrics
from mpicrossbow.training.run.step import train_step

STEPS = 6
BATCH = 8
OPTIM = OptimSection(lr=0.1, momentum=0.9, weight_decay=1e-3)


#: bucket_mb values: 0 = one allreduce after backward; MLP(hidden=32)'s largest parameter is 64×32 floats
#: (8 KiB): 0.004 MiB cuts buckets smaller than it (several small parameters share one, large ones are
#: alone), 1e-5 gives every parameter its own bucket, 100 puts everything in one.
BUCKETS = (0.0, 0.004, 1e-5, 100.0)


def make_pool(rank: int, size: int, learners: int = 1, engine: type = SerialPool) -> SerialPool:
    torch.manual_seed(rank + 100)  # different initial replicas: bind() must broadcast rank 0's
    return engine(
        MLP(hidden=32), PoolSpec(rank, size, BATCH, OPTIM, torch.device("cpu"), seed=5, learners=learners)
    )


def train_bsp(
    size: int,
    mode: str,
    learners: int = 1,
    bucket_mb: float = 0.0,
    engine: type = SerialPool,
    skip: tuple[int, int] | None = None,
) -> list[np.ndarray]:
    """Final flat parameters of every learner of every rank after STEPS steps of BSP in ``mode``.

    ``skip = (rank, step)``: that rank's learner 0 gets a NaN loss at that step and its gradient is zeroed
    after backward, as the session does with ``[session] on_nan = skip``.
    """
    pools = [make_pool(r, size, learners, engine) for r in range(size)]
    initial = pools[0].learners[0].params.clone()

    def body(comm):
        pool = pools[comm.rank]
        rule = BSP(mode=mode, bucket_mb=bucket_mb).bind(comm, pool)
        buckets = rule.buckets if mode == "grad" else None
        # 100 MiB holds the whole gradient: one bucket, which would overlap nothing, so none (one allreduce)
        assert (buckets is not None) == (mode == "grad" and 0 < bucket_mb < 100)

        def guard(step: int) -> None:
            if buckets is not None:  # every bucket but the last (it carries the NaN flag) left in backward
                assert buckets._next == len(buckets.buckets) - 1
            if skip == (comm.rank, step):
                pool.learners[0].last_loss = torch.tensor(float("nan"))
                pool.learners[0].grads.zero_()

        pool.start_epoch(0)
        for step in range(STEPS):
            train_step(pool, rule, step, step, guard)
        rule.finish()
        return [learner.params.numpy().copy() for learner in pool.learners]

    final = [params for per_rank in InProcessWorld(size).run(body) for params in per_rank]
    assert not torch.equal(initial, torch.from_numpy(final[0]))
    return final


def union_reference(size: int, learners: int = 1) -> np.ndarray:
    """One process, one replica (rank 0's initial weights), each step on every learner's batch at once."""
    pools = [make_pool(r, size, learners) for r in range(size)]
    module = copy.deepcopy(pools[0].learners[0].module)
    opt = torch.optim.SGD(
        module.parameters(), lr=OPTIM.lr, momentum=OPTIM.momentum, weight_decay=OPTIM.weight_decay
    )
    iters = [iter(data.train_batches(0)) for p in pools for data in p.datas]
    for _ in range(STEPS):
        batches = [next(it) for it in iters]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()


@pytest.mark.parametrize(("size", "learners"), [(1, 1), (2, 1), (4, 1), (1, 3), (2, 2), (4, 2)])
def test_grad_mode_equals_one_process_on_the_union_of_batches(size: int, learners: int) -> None:
    """k = ranks × learners: the mean gradient over every learner of every rank, replicas identical; every
    bucket size gives bitwise the same weights as the one allreduce after backward."""
    plain = train_bsp(size, "grad", learners)
    assert len(plain) == size * learners
    for params in plain[1:]:
        np.testing.assert_array_equal(params, plain[0])  # replicas stay identical
    np.testing.assert_allclose(plain[0], union_reference(size, learners), rtol=1e-5, atol=1e-6)
    for bucket_mb in BUCKETS[1:]:
        for params in train_bsp(size, "grad", learners, bucket_mb):
            np.testing.assert_array_equal(params, plain[0], err_msg=f"bucket_mb = {bucket_mb}")


@pytest.mark.parametrize("size", [1, 2])
def test_fused_engine_buckets_equal_its_one_allreduce(size: int) -> None:
    """The fused engine reports each fused parameter once for all m rows; results as without buckets."""
    plain = train_bsp(size, "grad", 3, engine=FusedPool)
    np.testing.assert_allclose(plain[0], union_reference(size, 3), rtol=1e-5, atol=1e-6)
    for bucket_mb in BUCKETS[1:]:
        for params in train_bsp(size, "grad", 3, bucket_mb, engine=FusedPool):
            np.testing.assert_array_equal(params, plain[0], err_msg=f"bucket_mb = {bucket_mb}")


def test_a_skipped_nonfinite_learner_is_left_out_with_overlap_too() -> None:
    """on_nan = skip zeroes a gradient after its buckets left: the step is redone without it, as without
    buckets (the NaN flag of the last bucket tells every rank)."""
    plain = train_bsp(2, "grad", 2, skip=(1, 3))
    assert np.isfinite(plain[0]).all()
    np.testing.assert_array_equal(train_bsp(2, "grad", 2, 0.004, skip=(1, 3))[0], plain[0])
    assert not np.array_equal(train_bsp(2, "grad", 2, 0.004)[0], plain[0])  # the skip changed something


@pytest.mark.parametrize("engine", [SerialPool, FusedPool])
def test_buckets_follow_a_resized_pool(engine: type) -> None:
    """[pool] learners = auto: after resize() and on_resize() the hooks watch the new learners."""

    def run(bucket_mb: float) -> list[np.ndarray]:
        pools = [make_pool(r, 2, 1, engine) for r in range(2)]

        def body(comm):
            pool = pools[comm.rank]
            rule = BSP(mode="grad", bucket_mb=bucket_mb).bind(comm, pool)
            for epoch, learners in enumerate((1, 2)):
                if learners != len(pool.learners):
                    pool.resize(learners)
                    rule.on_resize()
                pool.start_epoch(epoch)
                for step in range(3):
                    train_step(pool, rule, step, step)
            rule.finish()
            return [learner.params.numpy().copy() for learner in pool.learners]

        return [p for part in InProcessWorld(2).run(body) for p in part]

    plain = run(0.0)
    assert len(plain) == 4
    for params in run(0.004):
        np.testing.assert_array_equal(params, plain[0])


def test_plan_buckets_cuts_whole_parameters_from_the_last() -> None:
    from mpicrossbow.rules.grad_buckets import contiguous, plan_buckets

    layout = [(0, 10), (10, 3), (13, 40), (53, 2), (55, 2)]
    assert contiguous(layout, 57) and not contiguous(layout, 58) and not contiguous([(0, 2), (3, 1)], 4)
    cut = [(b.start, b.end, b.params) for b in plan_buckets(layout, 13)]
    assert cut == [(53, 57, [3, 4]), (13, 53, [2]), (0, 13, [0, 1])]
    assert [(b.start, b.end) for b in plan_buckets(layout, 1000)] == [(0, 57)]
    assert len(plan_buckets(layout, 1)) == 5


@pytest.mark.parametrize(("size", "learners"), [(1, 2), (2, 1), (4, 1)])
def test_avg_mode_equals_local_steps_then_numpy_mean(size: int, learners: int) -> None:
    out = run_world(
        size, lambda: BSP(mode="avg"), STEPS, model=lambda: MLP(hidden=32), optim=OPTIM, learners=learners
    )
    sgd = reference.Sgd(OPTIM.lr, OPTIM.momentum, weight_decay=OPTIM.weight_decay)
    w = reference.bsp_avg(out.w0, out.learner_grads(), sgd)
    final = out.learner_final()
    np.testing.assert_allclose(final[0], w[0], rtol=1e-5, atol=1e-6)
    for params in final[1:]:
        np.testing.assert_array_equal(params, final[0])


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_buckets_under_mpiexec_equal_the_one_allreduce_and_the_union(
    mpiexec: str, tmp_path: Path, ranks: int
) -> None:
    """The real MPI communicator (MPICH's Iallreduce per bucket, progressed from the hooks), 1 and 2 learners
    per rank, each bucket size: replicas identical, equal to the one-allreduce run (bitwise on 2 ranks, where
    any summation order gives a + b; on 4 ranks MPI may pick another algorithm, so another order, for a
    bucket than for the whole buffer), and to one process on the union of batches."""
    out = tmp_path / "report.json"
    proc = run_mpi(
        mpiexec, ranks, [sys.executable, "tests/mpi_scripts/bsp_overlap.py", str(out)], timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["learners"], r["bucket_mb"]) for r in rows} == {(m, mb) for m in (1, 2) for mb in BUCKETS}
    for row in rows:
        assert row["replicas_identical"], row
        assert row["equal_to_plain"] if ranks == 2 else row["max_diff_to_plain"] <= 1e-6, row
        assert row["max_diff_to_union"] <= 1e-5, row


@pytest.mark.mpi
def test_digits_job_with_overlapping_buckets_reaches_95_percent(mpiexec: str, tmp_path: Path) -> None:
    """The default job with buckets small enough that the MLP gradient leaves in 4 pieces during backward."""
    args = [*launcher(), "-cfg", "launch/digits.cfg", "rule.bucket_mb=0.01", f"session.output={tmp_path}"]
    args.append("comm.shared_memory=off")  # plain MPI: its non-blocking allreduce overlaps, so buckets run
    proc = run_mpi(mpiexec, 2, args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "BSP overlap: 4 bucket(s) of ≤ 0.01 MiB over 6 parameter tensor(s), 1 learner(s)" in proc.stderr
    accuracy = read_metrics(only_run(tmp_path) / "metrics.h5")["val"]["accuracy"]
    assert accuracy[-1] >= 0.95, accuracy


class _Blocking(CompressedCommunicator):
    """A communicator whose async allreduce completes before returning (as the shared-memory one's)."""

    @property
    def overlaps(self) -> bool:
        return False


def test_buckets_are_skipped_when_the_communicator_cannot_overlap() -> None:
    """Buckets only add synchronisations where allreduce(async_op=True) blocks: BSP keeps one allreduce,
    with the same result."""
    pools = [make_pool(r, 2) for r in range(2)]
    reference = train_bsp(2, "grad")

    def body(comm):
        rule = BSP(mode="grad", bucket_mb=0.004).bind(
            _Blocking(comm, torch.bfloat16, min_numel=1 << 30), pools[comm.rank]
        )
        assert rule.buckets is None
        pools[comm.rank].start_epoch(0)
        for step in range(STEPS):
            train_step(pools[comm.rank], rule, step, step)
        return [learner.params.numpy().copy() for learner in pools[comm.rank].learners]

    final = [params for per_rank in InProcessWorld(2).run(body) for params in per_rank]
    for got, want in zip(final, reference, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_swap_mode_pairs_ranks_that_trade_their_replicas(size: int) -> None:
    """Every step each rank of a pair takes its partner's weights (learner by learner); with an odd size the
    rank left over keeps its own; every rank draws the same pairs without talking."""
    from mpicrossbow.comm import Communicator
    from mpicrossbow.rules.pair_swap import PairSwap, partner
    from mpicrossbow.testing import InProcessWorld

    def body(comm: Communicator) -> list[list[float]]:
        flats = [torch.full((5,), 10.0 * comm.rank + j) for j in range(2)]
        swapper = PairSwap(comm, flats)
        seen = []
        for step in range(3):
            swapper.swap(step)
            seen.append([float(flat[0]) for flat in flats])
        return seen

    results = InProcessWorld(size).run(body)
    holder = {r: r for r in range(size)}  # whose original replica each rank holds
    for step in range(3):
        pairs = [partner(r, size, step) for r in range(size)]
        assert all(p is None or pairs[p] == r for r, p in enumerate(pairs)) and pairs.count(None) == size % 2
        holder = {r: holder[r] if pairs[r] is None else holder[pairs[r]] for r in range(size)}
        for r in range(size):
            assert results[r][step] == [10.0 * holder[r], 10.0 * holder[r] + 1], (step, r)
