"""The LearnerPool contract, bound to every registered engine (``ENGINES.names()``).

What the session and the rules rely on, whichever engine runs: the steps of an epoch and each learner's
shard; every learner's flat ``params``, ``grads`` and ``buffers`` are the replica's live state (a rule that
writes them changes what the replica computes and what its optimizer steps); training changes every
replica and counts its samples; validation counts the validation shards and swaps weights in only for the
evaluation; the state round-trips through a checkpoint file; resizing keeps learner 0 and copies it; a
learner whose loss is not finite is named. Engines that need CUDA (``streams``) run where a GPU is.
Engine-specific behaviour (the fused engine against the serial one, fusable layers) is in test_fused.py and
test_streams.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import NormedMLP
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import CheckpointError, DataError
from mpicrossbow.model.shard import Shard
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.engines import ENGINES
from mpicrossbow.pool.fused.replicated_network import ReplicatedNetwork
from mpicrossbow.pool.fused.vmapped import VmappedNetwork
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.training.checkpoints.checkpoint_files import FORMAT_VERSION, atomic_save, safe_load

#: Engines that run only on a CUDA device; every other engine runs on the CPU.
NEEDS_CUDA = {"STREAMS"}
OPTIM = OptimSection(lr=0.1, momentum=0.9)
#: How each engine refuses the checkpoint of a 2-learner pool in a 1-learner pool (a CheckpointError).
FEWER_LEARNERS = {
    "FUSED": "another model or learner count",
    "FUSED-REPLICATED": "another model or learner count",
    "FUSED-VMAP": "another model or learner count",
    "FUSED-UNFUSED": "another model or learner count",
    "SERIAL": "checkpoint holds 2 learner(s) per rank, this pool has 1",
    "STREAMS": "checkpoint holds 2 learner(s) per rank, this pool has 1",
}
BATCH, SEED = 8, 3


def engine_params() -> list[Any]:
    """One parameter per registered engine; a CUDA-only engine is skipped without a GPU."""
    no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return [
        pytest.param(name, id=name.lower(), marks=[pytest.mark.cuda, no_gpu] if name in NEEDS_CUDA else [])
        for name in ENGINES.names()
    ] + [
        pytest.param("FUSED-REPLICATED", id="fused-replicated"),  # its path for any network
        pytest.param("FUSED-VMAP", id="fused-vmap"),  # and for a forward that path cannot follow
        pytest.param("FUSED-UNFUSED", id="fused-unfused"),  # its replicas one after another (fuse = never)
    ]


ENGINE = pytest.mark.parametrize("engine", engine_params())


def device(engine: str) -> torch.device:
    """Where ``engine``'s replicas live in these tests."""
    return torch.device("cuda", 0) if engine in NEEDS_CUDA else torch.device("cpu")


def make_pool(
    engine: str, learners: int = 2, rank: int = 0, size: int = 1, hidden: int = 8, seed: int = 0
) -> LearnerPool:
    """An ``engine`` pool of BatchNorm MLP replicas (torch seed ``seed``) on the digits."""
    torch.manual_seed(seed)
    spec = PoolSpec(rank, size, BATCH, OPTIM, device(engine), seed=SEED, learners=learners)
    if engine in ("FUSED-REPLICATED", "FUSED-VMAP"):
        model = WrappedNormedMLP(hidden=hidden, derived=engine == "FUSED-VMAP")
        return ENGINES.get("FUSED")(model, dataclasses.replace(spec, fuse="always"))
    if engine == "FUSED-UNFUSED":
        return ENGINES.get("FUSED")(NormedMLP(hidden=hidden), dataclasses.replace(spec, fuse="never"))
    return ENGINES.get(engine)(NormedMLP(hidden=hidden), spec)


class Wrapped(nn.Module):
    """A network in a container of the user's own: the fused engine runs its forward on every replica's
    values; with ``derived`` a gain computed from a parameter outside any operator on the input, which
    that path cannot follow: then vmap runs it."""

    def __init__(self, body: nn.Module, derived: bool) -> None:
        super().__init__()
        self.body, self.derived = body, derived
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The body's output times the gain."""
        return self.body(x) * (self.gain.clone() if self.derived else self.gain)


class WrappedNormedMLP(NormedMLP):
    """NormedMLP's replicas inside :class:`Wrapped`."""

    def __init__(self, hidden: int = 8, derived: bool = False) -> None:
        super().__init__(hidden=hidden)
        self.derived = derived

    def module(self) -> nn.Module:
        """The same replica as NormedMLP's, wrapped."""
        return Wrapped(super().module(), self.derived)


def shards(learners: int, rank: int = 0, size: int = 1) -> list[Shard]:
    """Learner j of rank r reads shard ``r·m + j`` of ``size·m``."""
    return [Shard(rank * learners + j, size * learners, BATCH, SEED) for j in range(learners)]


def steps_per_epoch(learners: int, rank: int = 0, size: int = 1) -> int:
    """The smallest of the learners' shards' batch counts, from the model's data directly."""
    return min(NormedMLP().data(shard).n_batch_train for shard in shards(learners, rank, size))


def train(pool: LearnerPool, steps: int, epoch: int = 0) -> None:
    """``steps`` steps of compute and apply from the start of ``epoch``."""
    pool.start_epoch(epoch)
    for count in range(steps):
        pool.compute(count)
        pool.apply()


def outputs(pool: LearnerPool, x: torch.Tensor) -> list[torch.Tensor]:
    """Every replica's eval-mode output on ``x``, through its own module."""
    result = []
    with torch.no_grad():
        for learner in pool.learners:
            learner.module.eval()
            result.append(learner.module(x.to(learner.params.device)).cpu())
    return result


def assert_flat_state_is_live(pool: LearnerPool) -> None:
    """Writing one learner's flat params or buffers changes that replica's output and no other's."""
    x = torch.randn(4, 64)
    for j, learner in enumerate(pool.learners):
        module_params = [p for p in learner.module.parameters() if p.requires_grad]
        float_buffers = [b for b in learner.module.buffers() if b.is_floating_point()]
        for flat, numel in (
            (learner.params, sum(p.numel() for p in module_params)),
            (learner.grads, sum(p.numel() for p in module_params)),
            (learner.buffers, sum(b.numel() for b in float_buffers)),
        ):
            assert flat.ndim == 1 and flat.is_contiguous() and flat.numel() == numel
        for flat in (learner.params, learner.buffers):
            before = outputs(pool, x)
            saved = flat.clone()
            flat.mul_(2.0)
            after = outputs(pool, x)
            flat.copy_(saved)
            for i, (a, b) in enumerate(zip(before, after, strict=True)):
                assert torch.equal(a, b) != (i == j), f"learner {j}'s write reached replica {i}: {i == j}"


@ENGINE
def test_steps_per_epoch_and_shards(engine: str) -> None:
    """Rank 1 of 2 with 2 learners: learners read shards 2 and 3 of 4; an epoch is the smaller shard's
    batches, and a step past it is a DataError."""
    pool = make_pool(engine, learners=2, rank=1, size=2)
    assert [d.shard for d in pool.datas] == shards(2, rank=1, size=2)  # type: ignore[attr-defined]
    n = steps_per_epoch(2, rank=1, size=2)
    assert pool.n_batch_train == n > 0
    pool.start_epoch(0)
    pool.skip(n)
    with pytest.raises(
        DataError, match=f"train_batches\\(\\) ended after {n} batches but n_batch_train says {n}"
    ):
        pool.compute(n)


@ENGINE
def test_flat_buffers_are_each_replicas_live_state(engine: str) -> None:
    """A rule writes ``params``/``buffers`` in place; ``grads`` is what the optimizer steps with."""
    pool = make_pool(engine, learners=3)
    assert_flat_state_is_live(pool)
    before = [learner.params.clone() for learner in pool.learners]
    pool.start_epoch(0)
    pool.compute(0)
    assert all(learner.grads.abs().sum() > 0 for learner in pool.learners)
    pool.learners[1].grads.zero_()  # as a rule may (BSP's on_nan = skip): learner 1 takes no step
    pool.apply()
    assert torch.equal(pool.learners[1].params, before[1])
    for j in (0, 2):
        assert not torch.equal(pool.learners[j].params, before[j])


@ENGINE
def test_training_moves_every_replica_and_counts_its_samples(engine: str) -> None:
    pool = make_pool(engine, learners=2)
    before = [(learner.params.clone(), learner.buffers.clone()) for learner in pool.learners]
    train(pool, 3)
    for learner, (params, buffers) in zip(pool.learners, before, strict=True):
        assert not torch.equal(learner.params, params) and not torch.equal(learner.buffers, buffers)
    loss, hits, n = pool.take_stats()
    assert n == 3 * 2 * BATCH and 0 <= hits <= n and loss > 0
    assert pool.take_stats() == (0.0, 0.0, 0.0)


@ENGINE
def test_a_zero_learning_rate_leaves_the_replicas_alone(engine: str) -> None:
    pool = make_pool(engine, learners=2)
    pool.set_lr(0.0, 0)
    before = [learner.params.clone() for learner in pool.learners]
    train(pool, 1)
    for learner, params in zip(pool.learners, before, strict=True):
        assert torch.equal(learner.params, params)


@ENGINE
def test_validate_counts_the_validation_shards(engine: str) -> None:
    """``(loss sum, hits, samples)`` of learner 0 over every learner's validation shard, or over ``data``."""
    pool = make_pool(engine, learners=2)
    model = NormedMLP()
    own = sum(len(y) for shard in shards(2) for _, y in model.data(shard).val_batches())
    loss, hits, n = pool.validate()
    assert n == own and 0 <= hits <= n and loss > 0
    other = model.data(Shard(0, 4, BATCH, SEED))
    assert pool.validate(data=other)[2] == sum(len(y) for _, y in other.val_batches())


@ENGINE
def test_validating_other_weights_leaves_learner_zero_unchanged(engine: str) -> None:
    """``validate(params)`` scores ``params`` as learner 0 holding them would, then restores learner 0."""
    pool = make_pool(engine, learners=2)
    first = pool.learners[0].params
    mine, theirs = first.clone(), pool.learners[1].params.clone()
    own = pool.validate()
    swapped = pool.validate(theirs)
    assert swapped != own
    assert torch.equal(first, mine)
    assert pool.validate() == own
    first.copy_(theirs)
    assert pool.validate() == swapped


@ENGINE
def test_state_round_trips_through_a_checkpoint_file(engine: str, tmp_path: Path) -> None:
    """A pool restored from another's state (written and read back as a checkpoint is) trains on exactly
    as the original; another model or learner count is a CheckpointError."""
    pools = [make_pool(engine, learners=2, seed=seed) for seed in (0, 1)]
    train(pools[0], 3)
    atomic_save({"version": FORMAT_VERSION, "pool": pools[0].state_dict()}, tmp_path / "pool.pt")
    pools[1].load_state_dict(safe_load(tmp_path / "pool.pt", "file")["pool"])
    for pool in pools:  # the same next step from the restored state
        pool.start_epoch(0)
        pool.skip(3)
        pool.compute(3)
        pool.apply()
    for a, b in zip(pools[0].learners, pools[1].learners, strict=True):
        assert torch.equal(a.params, b.params) and torch.equal(a.buffers, b.buffers)
    assert pools[0].take_stats() == pools[1].take_stats()
    with pytest.raises(CheckpointError, match="another model"):
        make_pool(engine, learners=2, hidden=16).load_state_dict(pools[0].state_dict())
    with pytest.raises(CheckpointError, match=re.escape(FEWER_LEARNERS[engine])):
        make_pool(engine, learners=1).load_state_dict(pools[0].state_dict())


@ENGINE
def test_resize_keeps_learner_zero_and_copies_it(engine: str) -> None:
    """Growing keeps the learners (momentum included) and adds copies of learner 0 (weights, buffers,
    momentum) reading new shards; shrinking keeps the first learners. Every learner's state stays live."""
    pool, same = make_pool(engine, learners=2), make_pool(engine, learners=2)
    train(pool, 1)  # the learners have momentum now
    train(same, 1)
    first = (pool.learners[0].params.clone(), pool.learners[0].buffers.clone())
    pool.resize(3)
    assert len(pool.learners) == 3
    assert [d.shard for d in pool.datas] == shards(3)  # type: ignore[attr-defined]
    assert pool.n_batch_train == steps_per_epoch(3)
    for learner in (pool.learners[0], pool.learners[2]):
        assert torch.equal(learner.params, first[0]) and torch.equal(learner.buffers, first[1])
    assert_flat_state_is_live(pool)
    for learner in [*pool.learners, *same.learners]:  # a step on zero gradients: each moves by its momentum
        learner.grads.zero_()
    pool.apply()
    same.apply()
    assert not torch.equal(pool.learners[0].params, first[0])
    for j, k in ((0, 0), (1, 1), (2, 0)):  # learners 0 and 1 kept their momentum, learner 2 has learner 0's
        assert torch.equal(pool.learners[j].params, same.learners[k].params), (j, k)
    train(pool, 1, epoch=1)
    assert not torch.equal(pool.learners[1].params, pool.learners[2].params)  # different batches
    kept = pool.learners[0].params.clone()
    pool.resize(1)
    assert len(pool.learners) == 1 and torch.equal(pool.learners[0].params, kept)
    assert [d.shard for d in pool.datas] == shards(1)  # type: ignore[attr-defined]
    assert pool.n_batch_train == steps_per_epoch(1)


@ENGINE
def test_nonfinite_names_the_learner_whose_loss_is_not_finite(engine: str) -> None:
    pool = make_pool(engine, learners=3)
    pool.start_epoch(0)
    pool.compute(0)
    assert pool.nonfinite() == []
    pool.learners[1].params.fill_(float("nan"))
    pool.compute(1)
    assert pool.nonfinite() == [1]


def guard_params() -> list[Any]:
    """Every engine where its tests put it, read at once and deferred (as on a GPU, where flags are read
    when the device has written them), and the serial and fused engines on a GPU too."""
    no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    on_gpu = [pytest.param(e, "cuda", id=f"{e.lower()}-on-cuda", marks=[pytest.mark.cuda, no_gpu])
              for e in ("SERIAL", "FUSED")]  # fmt: skip
    deferred = [
        pytest.param(*p.values, "deferred", id=f"{p.id}-deferred", marks=p.marks) for p in engine_params()
    ]
    at_once = [pytest.param(*p.values, None, id=p.id, marks=p.marks) for p in engine_params()]
    return at_once + deferred + on_gpu


@pytest.mark.parametrize(("engine", "where", "on_nan"), [
    pytest.param(*p.values, on_nan, id=f"{p.id}-{on_nan}", marks=p.marks)
    for p in guard_params() for on_nan in ("skip", "stop")
])  # fmt: skip
def test_the_nan_guard_zeroes_or_stops_on_the_learner_whose_loss_is_not_finite(
    engine: str, where: str | None, on_nan: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``[session] on_nan``: a NaN in learner 1's loss zeroes its gradient alone (skip, one warning naming
    the step) or stops the job naming the step (stop), by the epoch's end at the latest (deferred on CUDA)."""
    from mpicrossbow.config import InjectSection
    from mpicrossbow.training.health.faults import FaultInjector
    from mpicrossbow.training.run.nan_guard import NanGuard, NonFiniteLoss

    if where == "cuda":
        torch.manual_seed(0)
        spec = PoolSpec(0, 1, BATCH, OPTIM, torch.device("cuda", 0), seed=SEED, learners=3)
        pool = ENGINES.get(engine)(NormedMLP(hidden=8), spec)
    else:
        pool = make_pool(engine, learners=3)
    guard = NanGuard(on_nan, defer=True if where == "deferred" else None)
    faults = FaultInjector(InjectSection(), 0)
    flags = pool.nonfinite_flags()
    pool.start_epoch(0)
    pool.compute(0)
    guard.check(pool, faults, 0, 0)
    assert flags is None or not pool.nonfinite_flags().any()
    saved = pool.learners[1].params.clone()
    pool.learners[1].params.fill_(float("nan"))
    pool.compute(1)
    assert pool.nonfinite() == [1]
    assert flags is None or pool.nonfinite_flags().tolist() == [False, True, False]
    caplog.set_level(logging.WARNING, logger="mpicrossbow.training.run.nan_guard")
    if on_nan == "stop":
        with pytest.raises(NonFiniteLoss, match=r"at step 7 \(epoch 2\), learner\(s\) 1; lower \[optim\] lr"):
            guard.check(pool, faults, 7, 1)
            guard.flush()
        guard.flush()  # nothing left in flight
        return
    guard.check(pool, faults, 7, 1)
    guard.flush()
    assert [r.getMessage() for r in caplog.records if r.name.endswith(".nan_guard")] == [
        "loss is NaN or infinite at step 7 (epoch 2), learner(s) 1: "
        "that batch is skipped (its gradient zeroed)"
    ]
    assert not pool.learners[1].grads.any()
    assert pool.learners[0].grads.any() and pool.learners[2].grads.any()
    pool.learners[1].params.copy_(saved)


def test_the_deferred_nan_guard_reads_a_step_once_the_device_wrote_it_and_waits_beyond_four_in_flight(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A device still busy (its flags not written: ``query()`` False) holds the verdict back, and the host
    runs at most IN_FLIGHT steps ahead: with step 1's loss NaN, the warning comes at step 1 + IN_FLIGHT's
    check, when the host waits for the oldest; a flush reads the rest."""
    from mpicrossbow.config import InjectSection
    from mpicrossbow.training.health.faults import FaultInjector
    from mpicrossbow.training.run import nan_guard

    monkeypatch.setattr(nan_guard.Written, "query", lambda self: False)
    pool = make_pool("SERIAL", learners=2)
    guard, faults = nan_guard.NanGuard("skip", defer=True), FaultInjector(InjectSection(), 0)
    caplog.set_level(logging.WARNING, logger="mpicrossbow.training.run.nan_guard")

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name.endswith(".nan_guard")]

    for step in range(1 + nan_guard.IN_FLIGHT):
        for learner in pool.learners:
            bad = step == 1 and learner is pool.learners[1]
            learner.last_loss = torch.tensor(float("nan") if bad else 0.5)
        guard.check(pool, faults, step, 0)
        assert warned() == [], step
    guard.check(pool, faults, 1 + nan_guard.IN_FLIGHT, 0)
    assert [m.split(":")[0] for m in warned()] == [
        "loss is NaN or infinite at step 1 (epoch 1), learner(s) 1"
    ]
    guard.flush()
    assert len(warned()) == 1 and not guard._pending


def test_the_fused_bindings_take_the_paths_they_name() -> None:
    """FUSED-REPLICATED runs its forward on every replica's values; FUSED-VMAP falls back to vmap."""
    for engine, path in (("FUSED-REPLICATED", ReplicatedNetwork), ("FUSED-VMAP", VmappedNetwork)):
        pool = make_pool(engine)
        assert isinstance(pool.fused, ReplicatedNetwork)
        train(pool, 1)
        assert isinstance(pool.fused, path)
