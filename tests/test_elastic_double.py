"""Elastic recovery in-process, on the fault double (mpicrossbow/testing/fault_double.py: ranks as threads,
deaths injected on demand): the commit agreement, a step dropped on every survivor, the divisor following
the new size, min_ranks. What needs a real ULFM job is in tests/test_elastic_mpi.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import OPTIM
from models.mlp import MLP
from mpicrossbow.comm.base import Handle, ReduceOp
from mpicrossbow.comm.elastic import ElasticCommunicator
from mpicrossbow.comm.forwarding import ForwardingCommunicator
from mpicrossbow.comm.ulfm import ElasticEnd, PeerLost
from mpicrossbow.launch.world import World
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules.gosgd import UNIT
from mpicrossbow.rules.registry import RULES
from mpicrossbow.testing.fault_double import FaultyGroup, FaultyWorld
from mpicrossbow.training.elastic.fault_tolerance import cloned
from mpicrossbow.training.elastic.run_tolerance import RunTolerance
from mpicrossbow.training.health.drill import ExchangeTrap
from mpicrossbow.training.run.step import train_step


def test_a_dead_rank_makes_the_commit_false_everywhere_and_the_survivors_shrink() -> None:
    """Rank 1 of 3 dies before the commit: the agreement says no on both survivors (also the one whose
    own work succeeded); they shrink to start ranks (0, 2), renumbered 0 and 1, and commit and sum there."""
    world = FaultyWorld(3, timeout_s=10)

    def body(group: FaultyGroup) -> tuple[bool, tuple[int, ...], int, bool, float]:
        comm = ElasticCommunicator(group)
        if group.me == 1:
            world.die(1)
        first = comm.commit(True)
        membership = comm.recover()
        ones = torch.ones(1)
        comm.allreduce(ones).wait()
        return first, membership.ranks, membership.rank, comm.commit(True), float(ones)

    assert world.run(body) == [(False, (0, 2), 0, True, 2.0), None, (False, (0, 2), 1, True, 2.0)]


def test_an_operation_meeting_the_loss_raises_peer_lost_and_revokes() -> None:
    """Rank 2 dies before the allreduce: the others' allreduce raises PeerLost (not a hang) and the group
    is revoked, so a further operation fails at once too."""
    world = FaultyWorld(3, timeout_s=10)

    def body(group: FaultyGroup) -> tuple[bool, bool]:
        comm = ElasticCommunicator(group)
        if group.me == 2:
            world.die(2)
        with pytest.raises(PeerLost):
            comm.allreduce(torch.ones(1)).wait()
        with pytest.raises(PeerLost):
            comm.barrier()
        return group.state.revoked, comm.commit(True)

    assert world.run(body) == [(True, False), (True, False), None]


def pools(size: int) -> list[SerialPool]:
    """One small digits MLP pool per rank, built as the session builds them (rank r under seed r)."""
    built = []
    for rank in range(size):
        torch.manual_seed(rank)
        spec = PoolSpec(rank, size, 8, OPTIM, torch.device("cpu"), seed=1, learners=1)
        built.append(SerialPool(MLP(hidden=16), spec))
    return built


def parts(pool: SerialPool, rule: Any, rank: int, size: int) -> Any:
    """What RunTolerance reads of a rank's parts: pool, rule, the world and who follows it."""
    world = World(rank, size, rank, size, 0, 1, "h", None)
    follower = SimpleNamespace(world=world)
    checkpoints = SimpleNamespace(world=world, saver=None, position={})
    return SimpleNamespace(
        pool=pool, rule=rule, world=world, reporter=follower, evaluator=follower, checkpoints=checkpoints
    )


def falter() -> None:
    """A collective that completed here and on the others, reported as failed here."""
    raise PeerLost("this rank's collective reported the loss, the others' completed (fault double)")


def elastic_run(
    rule_name: str,
    size: int,
    victim: int,
    at: int,
    steps: int,
    min_ranks: int = 1,
    exchanging: bool = True,
    hyper: dict[str, Any] | None = None,
    every: int = 1,
    falters: int | None = None,
    heals: bool | None = None,
    redo: bool = False,
) -> list[Any]:
    """``steps`` elastic steps of ``rule_name`` on ``size`` fault-double ranks; ``victim`` dies in step
    ``at``: right after its first exchange operation completed when ``exchanging`` (the others' too: a step
    that completed its collective on every rank), else at the step's start; a commit every ``every`` steps.
    ``falters``: a rank whose first exchange operation of step ``at`` completes and then reports the loss
    (ULFM's collectives are not uniform: it failed there, and completed on the others). ``heals``: False
    commits BSP's grad mode in windows too (the windows' own tests), None lets the rule say. ``redo``: each
    step runs its exchange in the window's guard (as the session's loop does: ``train_step(window=...)``),
    so a step that met the loss can be redone; without it the step's loss drops it. Per survivor:
    its parameters after every step, its membership, its RunTolerance and its rule."""
    world, built = FaultyWorld(size, timeout_s=20), pools(size)

    def body(group: FaultyGroup) -> tuple[list[torch.Tensor], Any, RunTolerance, Any]:
        comm, pool = ElasticCommunicator(group), built[group.me]
        trapped = ExchangeTrap(comm)  # the drill's communicator, as the session binds it on a drilled rank
        rule = RULES.get(rule_name)(**(hyper or {})).bind(trapped, pool)
        steps_ = RunTolerance(parts(pool, rule, group.me, size), comm, min_ranks, every, heals=heals)
        pool.start_epoch(0)
        after = []

        def run(step: int) -> float:
            if group.me == victim and step == at and not exchanging:
                world.die(victim)  # at the step's start: the others meet the loss in its collectives
            return train_step(pool, rule, step, window=steps_ if redo else None)

        for step in range(steps):
            if group.me == victim and step == at and exchanging:
                trapped.arm(lambda: world.die(victim))
            if group.me == falters and step == at:
                trapped.arm(falter)
            steps_.step(lambda step=step: run(step), step)
            after.append(pool.learners[0].params.clone())
        return after, comm.membership, steps_, rule

    return world.run(body)


@pytest.mark.parametrize("rule", ["BSP", "SMA", "LOCALSGD", "EASGD"])
def test_the_step_that_met_the_loss_is_dropped_on_every_survivor(rule: str) -> None:
    """Rank 2 of 4 dies inside step 3's exchange after the collective completed everywhere (LOCALSGD's
    step 3 is a local one: at its start, met in the agreement): every survivor drops step 3 (its weights
    after it are those after step 2), recovers once, and the survivors end bitwise equal (BSP's replicas,
    SMA's z, LOCALSGD's replicas after its average at step 7, sync EASGD's
    centre, τ = 1). BSP's grad mode commits in windows here (it heals from a peer by default: below)."""
    hyper = {"tau": 1} if rule == "EASGD" else {}
    exchanging = rule != "LOCALSGD"
    results = elastic_run(rule, 4, victim=2, at=3, steps=8, exchanging=exchanging, hyper=hyper, heals=False)
    assert results[2] is None
    survivors = [r for r in results if r is not None]
    for after, membership, steps, _ in survivors:
        assert torch.equal(after[3], after[2])  # dropped: restored to the last committed step
        assert not torch.equal(after[4], after[3])  # and training goes on
        assert membership.ranks == (0, 1, 3) and membership.version == 1
        assert len(steps.recoveries) == 1 and steps.lost == (2,)
    held = [r[3].z if rule == "SMA" else r[3].centre if rule == "EASGD" else r[0][-1] for r in survivors]
    assert all(torch.equal(held[0], other) for other in held[1:])


@pytest.mark.parametrize("rule", ["BSP", "SMA", "LOCALSGD"])
def test_a_loss_inside_a_commit_window_drops_the_whole_window_on_every_survivor(rule: str) -> None:
    """A commit every 4 steps (``[elastic] commit_every``): rank 2 of 4 dies inside step 5's exchange
    (LOCALSGD, averaging every 8 steps: at step 5's start, met in the agreement after step 7). Every survivor
    trains no more in the window, restores the state of the last commit (after step 3) at its end — steps
    4-7 are dropped, step 4 although it completed everywhere — recovers once and trains on; the survivors end
    bitwise equal (BSP's replicas — its grad mode in windows here —, SMA's z, LOCALSGD's replicas after its
    average at step 15)."""
    results = elastic_run(
        rule, 4, victim=2, at=5, steps=16, exchanging=rule != "LOCALSGD", every=4, heals=False
    )
    assert results[2] is None
    survivors = [r for r in results if r is not None]
    for after, membership, steps, _ in survivors:
        assert not torch.equal(after[4], after[3])  # step 4 trained, then dropped with its window
        assert torch.equal(after[7], after[3])
        assert not torch.equal(after[8], after[7])  # and training goes on
        assert membership.ranks == (0, 1, 3) and len(steps.recoveries) == 1 and steps.lost == (2,)
        assert steps.committed == 16 and steps.pending == 0
    held = [r[3].z if rule == "SMA" else r[0][-1] for r in survivors]
    assert all(torch.equal(held[0], other) for other in held[1:])


def test_a_commit_window_commits_once_per_window() -> None:
    """No loss: with a commit every 4 steps, 10 steps take 2 agreements (after steps 3 and 7), and a flush
    ends the open window (steps 8-9) with a third; a second flush has nothing to commit."""
    world, built = FaultyWorld(2, timeout_s=20), pools(2)

    def body(group: FaultyGroup) -> list[int]:
        comm, pool = ElasticCommunicator(group), built[group.me]
        rule = RULES.get("BSP")().bind(comm, pool)
        steps_ = RunTolerance(parts(pool, rule, group.me, 2), comm, 1, every=4, heals=False)
        agreements = []
        commit = comm.commit

        def counted(ok: bool) -> bool:
            agreements.append(steps_.steps_done)
            return commit(ok)

        comm.commit = counted  # type: ignore[method-assign]
        pool.start_epoch(0)
        for step in range(10):
            steps_.step(lambda step=step: train_step(pool, rule, step), step)
        assert steps_.flush("the end") and steps_.flush("the end")
        return agreements

    assert world.run(body) == [[4, 8, 10]] * 2


@pytest.mark.parametrize(
    ("rule", "hyper", "met", "averaged"),
    [
        ("BSP", {}, 4, range(8)),
        ("SMA", {}, 4, ()),
        ("LOCALSGD", {"period": 2}, 5, (1, 3, 7)),
    ],
    ids=["BSP", "SMA", "LOCALSGD"],
)
def test_a_synchronous_rule_heals_from_a_peer_dropping_only_the_step_that_met_the_loss(
    caplog: pytest.LogCaptureFixture,
    rule: str,
    hyper: dict[str, Any],
    met: int,
    averaged: range | tuple[int, ...],
) -> None:
    """BSP's grad mode, SMA and LOCALSGD heal instead of committing windows: no agreement and no state copy
    per step. Rank 2 of 4 dies right after step 3's first collective completed everywhere: every survivor
    keeps step 3 (a completed collective is correct where it completed), meets the loss in its next
    collective (BSP's and SMA's in step 4; LOCALSGD's, averaging every 2 steps, in step 5), recovers once and
    drops that step only (BSP: its update; SMA: z's move; LOCALSGD: its average, the local step is kept). The
    survivors' shared state is bitwise equal: BSP's replicas after every step, LOCALSGD's after every
    average that completed, SMA's z; and the one line says which step was dropped."""
    skips: list[int] = []
    results = elastic_run(rule, 4, victim=2, at=3, steps=8, every=4, hyper=hyper)
    assert results[2] is None
    survivors = [r for r in results if r is not None]
    for after, membership, steps, _ in survivors:
        assert steps.heals and steps.saved is None  # never a copy of the state
        assert not torch.equal(after[3], after[2])  # step 3 kept
        assert not torch.equal(after[met + 1], after[met])  # and training goes on
        assert membership.ranks == (0, 1, 3) and len(steps.recoveries) == 1 and steps.committed == 8
        skips.append(steps.skip_until)
    if rule == "BSP":
        assert all(torch.equal(r[0][met], r[0][met - 1]) for r in survivors)  # step 4's update dropped
    for step in averaged:
        assert all(torch.equal(r[0][step], survivors[0][0][step]) for r in survivors), step
    if rule == "LOCALSGD":  # step 5's average dropped: each survivor keeps its own local step
        assert not torch.equal(survivors[0][0][met], survivors[1][0][met])
    if rule == "SMA":
        assert all(torch.equal(r[3].z, survivors[0][3].z) for r in survivors)
    assert skips == [met + 1] * 3
    lines = [r.getMessage() for r in caplog.records if "lost rank(s) 2" in r.getMessage()]
    assert len(lines) == 1 and f"at step {met}, step {met} dropped;" in lines[0], lines


def test_a_survivor_behind_heals_from_one_that_completed_the_step_and_skips_to_it() -> None:
    """ULFM's collectives are not uniform: step 3's allreduce completed on ranks 0 and 3 (and on rank 2,
    which then dies) but reported the loss on rank 1. Rank 1 still holds the state after step 2, ranks 0
    and 3 the one after step 3 and meet the loss in step 4. Rank 1 takes rank 0's state (weights and
    momentum: bitwise rank 0's after step 3), skips step 4 without training so every loop goes on at step
    5, and keeps its own running loss sums (not its source's); step 4 is the one step lost."""
    world, built = FaultyWorld(4, timeout_s=20), pools(4)

    def body(group: FaultyGroup) -> tuple[list[list[torch.Tensor]], torch.Tensor, int]:
        comm, pool = ElasticCommunicator(group), built[group.me]
        trapped = ExchangeTrap(comm)
        rule = RULES.get("BSP")().bind(trapped, pool)
        steps_ = RunTolerance(parts(pool, rule, group.me, 4), comm, 1)
        pool.start_epoch(0)
        after, trained = [], 0
        for step in range(7):
            if step == 3 and group.me in (1, 2):
                trapped.arm(falter if group.me == 1 else lambda: world.die(2))
            trained += steps_.step(lambda step=step: train_step(pool, rule, step) + 1.0, step) > 0
            state = pool.state_dict()["learners"][0]
            after.append([t.clone() for t in tensors([state["params"], state["optimizer"]])])
        return after, pool.learners[0]._stats.clone(), trained

    results = world.run(body)
    assert results[2] is None
    (after0, stats0, trained0), (after1, stats1, trained1), (after3, _, trained3) = (
        results[0],
        results[1],
        results[3],
    )
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # noqa: E731
    assert not same(after0[3], after0[2]) and same(after0[4], after0[3])  # 0 kept step 3, dropped 4
    assert same(after1[3], after0[3])  # rank 1 healed inside step 3 from rank 0's step 3
    assert same(after1[4], after1[3])  # and skipped step 4
    for step in range(3, 7):
        assert same(after1[step], after0[step]) and same(after3[step], after0[step]), step
    assert (trained0, trained1, trained3) == (6, 5, 6)  # rank 1 lost steps 3 and 4, the others step 4
    assert not torch.equal(stats1, stats0)  # its own shard's loss sums, not rank 0's


class _FailedWait(Handle):
    """An operation that completed (the others' too) whose wait reports the loss here."""

    def wait(self) -> None:
        falter()

    def test(self) -> bool:
        return True


class _LateFalter(ForwardingCommunicator):
    """``inner``; once armed, the next non-blocking allreduce completes and its wait reports the loss."""

    def __init__(self, inner: ElasticCommunicator) -> None:
        super().__init__(inner)
        self.armed = False

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        handle = self.inner.allreduce(tensor, op, async_op)
        if self.armed and async_op:
            self.armed = False
            handle.wait()
            return _FailedWait()
        return handle


def test_sma_heals_a_survivor_whose_overlapped_allreduce_failed_from_one_whose_completed() -> None:
    """SMA's allreduce of step 3 completes at step 4's start. It completed on ranks 0 and 3 (z moved for
    step 3; rank 2 dies right after it) and reported the loss on rank 1 as rank 1 waited for it, so rank 1's
    z lacks step 3's move though rank 1 completed step 3 as the others did. Rank 1 counts step 3 as not held
    (``Rule.unapplied_steps``) and takes rank 0's state: every survivor's z is bitwise the same after the
    loss and at the end (the CI run's SMA kill drill once ended with survivors' z apart)."""
    world, built = FaultyWorld(4, timeout_s=20), pools(4)

    def body(group: FaultyGroup) -> tuple[list[torch.Tensor], int, int]:
        comm, pool = ElasticCommunicator(group), built[group.me]
        late = _LateFalter(comm)
        trapped = ExchangeTrap(late)
        rule = RULES.get("SMA")().bind(trapped, pool)
        steps_ = RunTolerance(parts(pool, rule, group.me, 4), comm, 1)
        pool.start_epoch(0)
        zs = []
        for step in range(7):
            if step == 3 and group.me == 2:
                trapped.arm(lambda: world.die(2))
            late.armed = step == 3 and group.me == 1
            steps_.step(lambda step=step: train_step(pool, rule, step), step)
            zs.append(rule.z.clone())  # without completing the allreduce in flight: the loop does that
        return zs, steps_.committed, steps_.skip_until

    results = world.run(body)
    assert results[2] is None
    survivors = [results[rank] for rank in (0, 1, 3)]
    z0 = survivors[0][0]
    for zs, _, _ in survivors[1:]:
        assert all(torch.equal(zs[step], z0[step]) for step in range(4, 7))
    assert not torch.equal(z0[4], z0[3])  # z moved for step 3 on the survivors (rank 1's from rank 0)
    assert [(committed, skip) for _, committed, skip in survivors] == [(7, 5)] * 3


@pytest.mark.parametrize("keeps", ["amend", "refresh", "neither"])
def test_a_rate_set_between_windows_survives_a_dropped_window(keeps: str) -> None:
    """The rate drops tenfold between two windows (after step 3, commit every 4); rank 2 dies in step 5:
    the survivors restore the state of the last commit — with the new rate when the loop said so
    (``amend``: crossbow-launch's loop sets a scheduled rate) or the owner copies the state as every window
    starts (``refresh``: the embedded API, where the user's scheduler steps between windows); without
    either the old rate comes back, which is what both exist for."""
    world, built = FaultyWorld(4, timeout_s=20), pools(4)

    def body(group: FaultyGroup) -> float:
        comm, pool = ElasticCommunicator(group), built[group.me]
        rule = RULES.get("BSP")().bind(comm, pool)
        steps_ = RunTolerance(parts(pool, rule, group.me, 4), comm, 1, every=4, heals=False)
        steps_.refresh = keeps == "refresh"
        pool.start_epoch(0)
        for step in range(8):
            if step == 4:
                pool.set_lr(OPTIM.lr / 10, 0)
                if keeps == "amend":
                    steps_.amend()
            if group.me == 2 and step == 5:
                world.die(2)
            steps_.step(lambda step=step: train_step(pool, rule, step), step)
        assert steps_.recoveries, "the loss was met"
        return float(pool.learners[0].optimizer.param_groups[0]["lr"])

    rates = [r for r in world.run(body) if r is not None]
    assert len(rates) == 3
    expected = OPTIM.lr if keeps == "neither" else OPTIM.lr / 10
    assert rates == pytest.approx([expected] * 3)


@pytest.mark.parametrize(("switch_epoch", "phase"), [(0.05, "SMA"), (0.5, "BSP"), (0.09, "the switch")])
def test_post_local_sgd_recovers_in_either_phase(switch_epoch: float, phase: str) -> None:
    """POSTLOCALSGD (BSP, then SMA; 44 steps an epoch here): rank 2 dies inside step 3's exchange — after
    the switch (SMA from step 2), before it (BSP until step 22), or in step 3 itself, the last BSP step,
    whose exchange would have ended with the switch: every survivor drops step 3, recovers once, goes on in
    the phase the last committed step left (the switch then comes after step 4, on every survivor), and the
    survivors end bitwise equal (SMA's z, or BSP's replicas)."""
    results = elastic_run(
        "POSTLOCALSGD", 4, victim=2, at=3, steps=8, hyper={"switch_epoch": switch_epoch, "then": "SMA"}
    )
    assert results[2] is None
    survivors = [r for r in results if r is not None]
    for after, membership, steps, rule in survivors:
        assert torch.equal(after[3], after[2]) and not torch.equal(after[4], after[3])
        assert membership.ranks == (0, 1, 3) and len(steps.recoveries) == 1
        assert rule.active.name == ("BSP" if phase == "BSP" else "SMA")
        assert rule.switched_at == {"SMA": 2, "BSP": None, "the switch": 5}[phase]
    held = [r[3].active.z if phase != "BSP" else r[0][-1] for r in survivors]
    assert all(torch.equal(held[0], other) for other in held[1:])


def test_every_mean_divides_by_the_survivors_after_a_loss() -> None:
    """After losing one rank of four, BSP's k is 3 and its average of gradients 1, 2, 3 (one per
    survivor) is 2 everywhere: the divisor is the new size, not the start's 4."""
    results = elastic_run("BSP", 4, victim=1, at=2, steps=4)  # step 2 completed: met in step 3
    survivors = [r for r in results if r is not None]
    assert [r[3].world_learners for r in survivors] == [3, 3, 3]
    assert sorted(r[1].rank for r in survivors) == [0, 1, 2]

    world, built = FaultyWorld(4, timeout_s=20), pools(4)

    def body(group: FaultyGroup) -> float:
        comm, pool = ElasticCommunicator(group), built[group.me]
        rule = RULES.get("BSP")().bind(comm, pool)
        if group.me == 1:
            world.die(1)
        with pytest.raises(PeerLost):
            comm.barrier()
        comm.recover()
        rule.on_rebind((1,))
        pool.learners[0].grads.fill_(comm.rank + 1.0)
        rule.average("grads")
        return float(pool.learners[0].grads[0])

    assert world.run(body) == [2.0, None, 2.0, 2.0]


def test_fewer_ranks_than_min_ranks_ends_the_job_on_every_survivor() -> None:
    with pytest.raises(ElasticEnd, match="fewer than \\[elastic\\] min_ranks = 4"):
        elastic_run("BSP", 4, victim=3, at=1, steps=3, min_ranks=4)  # met in step 2


def train_losing_rank_2(world: FaultyWorld, me: int, pool: SerialPool, rule: Any, steps: int) -> None:
    """``steps`` training steps of rank ``me`` of an asynchronous run; rank 2 dies at the start of its step 5
    (after 5 exchanges)."""
    pool.start_epoch(0)
    for step in range(steps):
        if me == 2 and step == 5:
            world.die(2)
        train_step(pool, rule, step)


@pytest.mark.parametrize(
    ("rule_name", "hyper"),
    [
        ("ASGD", {}),
        ("SSP", {"staleness": 0}),
        ("PSGD", {"max_advance": 1}),
        ("WEEDOUT", {}),
        ("EASGD", {"mode": "async", "tau": 1}),
    ],
)
def test_a_parameter_server_forgets_a_lost_worker_and_serves_the_others_to_the_end(
    rule_name: str, hyper: dict[str, Any]
) -> None:
    """Rank 0 serves (EASGD: the centre), ranks 1-3 push every step; rank 2 dies at the start of its step 5
    (after 5 pushes). The server's receive from it raises and the server forgets it (SSP with staleness 0,
    PSGD with max_advance 1 would otherwise hold the other two behind it forever); the others push all their
    steps; after finish the ranks agree that one is missing and shrink, and the final model is the server's
    on every survivor."""
    steps, size = 12, 4
    world, built = FaultyWorld(size, timeout_s=20), pools(size)

    def body(group: FaultyGroup) -> tuple[Any, tuple[int, ...], torch.Tensor]:
        comm, pool = ElasticCommunicator(group), built[group.me]
        comm.isolate_peers = True
        rule = RULES.get(rule_name)(**hyper).bind(comm, pool)
        if group.me == 0:
            rule.serve(lambda w, epoch: None)
        else:
            train_losing_rank_2(world, group.me, pool, rule, steps)
        rule.finish()
        RunTolerance(parts(pool, rule, group.me, size), comm, 1).settle("the end of training")
        rule.sync_state()
        final = rule.centre if rule_name == "EASGD" else rule.w
        return rule.server, comm.membership.ranks, final.clone()

    results = world.run(body)
    assert results[2] is None
    server = results[0][0]
    discarded = getattr(server, "discarded", 0)  # WEEDOUT's stale pushes
    assert server.lost == {2} and server.updates + discarded == 2 * steps + 5 and server.in_flight == 0
    if rule_name != "EASGD":
        assert server.clock == {1: steps, 2: 5, 3: steps} and server.received == server.updates + discarded
    survivors = [r for r in results if r is not None]
    assert all(r[1] == (0, 1, 3) for r in survivors)
    assert all(torch.equal(r[2], survivors[0][2]) for r in survivors)


def test_gossip_forgets_a_lost_peer_and_the_survivors_average_renormalises() -> None:
    """GOSGD over 4 ranks, every learner gossiping every step (p = 1); rank 2 dies at the start of its step
    5. Every survivor meets the loss (a receive posted from rank 2, or a send to it) and forgets rank 2, the
    others gossip all their steps with each other, finish without its goodbye, agree and shrink; the final
    model is Σ a_i x_i / Σ a_i over the survivors' learners (the lost weight renormalised away), the same on
    every survivor."""
    steps, size = 12, 4
    world, built = FaultyWorld(size, timeout_s=20), pools(size)

    def body(group: FaultyGroup) -> tuple[set[int], list[int], torch.Tensor, tuple[int, ...], torch.Tensor]:
        comm, pool = ElasticCommunicator(group), built[group.me]
        comm.isolate_peers = True
        rule = RULES.get("GOSGD")(p=1.0).bind(comm, pool)
        train_losing_rank_2(world, group.me, pool, rule, steps)
        rule.finish()
        lost, masses, x = set(rule.lost), list(rule.masses), rule.xs[0].clone()
        RunTolerance(parts(pool, rule, group.me, size), comm, 1).settle("the end of training")
        rule.sync_state()
        return lost, masses, x, comm.membership.ranks, rule.average_params.clone()

    results = world.run(body)
    assert results[2] is None
    survivors = [r for r in results if r is not None]
    assert all(r[0] == {2} for r in survivors)
    assert all(r[3] == (0, 1, 3) for r in survivors)
    weight = sum(sum(r[1]) for r in survivors)
    assert 0 < weight < UNIT  # rank 2's share, and what was on the way to it, went with it
    want = sum(r[2].double() * (sum(r[1]) / weight) for r in survivors)
    for r in survivors:
        assert torch.allclose(r[4].double(), want, atol=1e-6)
        assert torch.equal(r[4], survivors[0][4])


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def test_losses_in_two_steps_in_a_row_both_restore_the_last_committed_state() -> None:
    """Rank 2 dies inside step 3's exchange, rank 1 inside step 4's: both steps are dropped, and after each
    the survivors' whole state — weights and the optimizer's momentum, which torch's load_state_dict keeps
    as the very tensors it was given — is what it was after step 2 (a restore must not hand the saved copy
    to the optimizer and then copy the next step into it)."""
    world, built = FaultyWorld(4, timeout_s=20), pools(4)

    def body(group: FaultyGroup) -> list[list[torch.Tensor]]:
        comm, pool = ElasticCommunicator(group), built[group.me]
        trapped = ExchangeTrap(comm)
        rule = RULES.get("BSP")().bind(trapped, pool)
        steps_ = RunTolerance(parts(pool, rule, group.me, 4), comm, 1, heals=False)
        pool.start_epoch(0)
        after = []
        for step in range(6):
            if (group.me, step) in ((2, 3), (1, 4)):
                trapped.arm(lambda me=group.me: world.die(me))
            steps_.step(lambda step=step: train_step(pool, rule, step), step)
            after.append([t.clone() for t in tensors(pool.state_dict())])
        return after

    for after in [r for r in world.run(body) if r is not None]:
        for dropped in (3, 4):
            assert all(torch.equal(a, b) for a, b in zip(after[dropped], after[2], strict=True)), dropped
        assert not all(torch.equal(a, b) for a, b in zip(after[5], after[2], strict=True))


def test_a_capture_is_copied_into_the_spare_copy_without_allocating() -> None:
    """The state copy of every step goes into the tensors of the copy before the last (same storage), and
    a tensor whose shape changed gets a fresh one."""
    spare = cloned({"a": [torch.zeros(3)], "b": torch.zeros(2), "n": 1})
    kept = spare["a"][0].data_ptr()
    copy = cloned({"a": [torch.ones(3)], "b": torch.ones(4), "n": 2}, spare)
    assert copy["a"][0].data_ptr() == kept and torch.equal(copy["a"][0], torch.ones(3))
    assert copy["b"].shape == (4,) and copy["n"] == 2


def completed_then_lost(comm: ElasticCommunicator, world: FaultyWorld, dies: bool) -> Any:
    """``comm``'s allreduce_mean, once: completed, then this rank dies (``dies``) or says it met a loss."""
    inner = comm.allreduce_mean

    def once(tensor: torch.Tensor, count: int) -> None:
        inner(tensor, count)
        del comm.allreduce_mean  # type: ignore[method-assign]
        if dies:
            world.die(comm.membership.original_rank)
        raise PeerLost("this rank's collective reported the loss, another's completed (fault double)")

    return once


@pytest.mark.parametrize(
    ("victim", "where"),
    [(2, "start"), (2, "inside"), (2, "non-uniform"), (1, "start"), (1, "inside")],
    ids=[
        "member-at-start",
        "member-inside-pull",
        "member-non-uniform",
        "leader-at-start",
        "leader-inside-pull",
    ],
)
def test_gsp_a_group_shrinks_around_a_lost_worker_and_the_server_forgets_it(
    tmp_path: Path, victim: int, where: str
) -> None:
    """GSP on 6 ranks: rank 0 serves, groups [1, 2, 3] and [4, 5], the leaders push every 3 steps (steps 2,
    5, 8, 11 of 13). Rank ``victim`` of the first group (2: a member, 1: its leader) dies in step 5 — at its
    start (the others' gradient average meets it), or right after its broadcast of the pull (the leader's
    push reached the server; the others' second broadcast meets it). The group's survivors shrink, redo the
    step over themselves and train on with bitwise-equal replicas after every step; a lost leader is replaced
    by the lowest survivor, rank 2, which pushes from then on; the other group never notices; the server
    forgets the lost rank; after finish the ranks agree, shrink, and the final w is the same everywhere.
    ``non-uniform``: rank 2 dies right after step 5's gradient average completed everywhere, and rank 3's
    average reports the loss while rank 1's does not (ULFM's collectives are not uniform): the group's
    agreement still drops the step on both, and both redo it over themselves."""
    steps, size = 13, 6
    groups = tmp_path / "groups"
    groups.write_text("1 2 3\n4 5\n")
    world, built = FaultyWorld(size, timeout_s=20), pools(size)

    def body(group: FaultyGroup) -> tuple[Any, Any, list[torch.Tensor], list[int], torch.Tensor]:
        comm, pool = ElasticCommunicator(group), built[group.me]
        comm.isolate_peers = True
        rule = RULES.get("GSP")(groups=str(groups), tau=3).bind(comm, pool)
        after = []
        if group.me == 0:
            rule.serve(lambda w, epoch: None)
        else:
            pool.start_epoch(0)
            for step in range(steps):
                if group.me == victim and step == 5:
                    if where == "start":
                        world.die(victim)
                if group.me == victim and step == 5 and where == "inside":
                    rule.group = trapped = ExchangeTrap(rule.group)  # the group's operations, trapped
                    # past the group's gradient average, then after its first broadcast of the pull
                    trapped.arm(lambda trap=trapped: trap.arm(lambda: world.die(victim)))
                if where == "non-uniform" and group.me in (victim, 3) and step == 5:
                    rule.group.allreduce_mean = completed_then_lost(rule.group, world, group.me == victim)
                train_step(pool, rule, step)
                after.append(pool.learners[0].params.clone())
        rule.finish()
        members = None if rule.elastic_group is None else rule.elastic_group.membership.ranks
        RunTolerance(parts(pool, rule, group.me, size), comm, 1).settle("the end of training")
        rule.sync_state()
        return rule.server, members, after, list(rule.lost_members), rule.w.clone()

    results = world.run(body)
    assert results[victim] is None
    server = results[0][0]
    assert server.lost == {victim} and server.in_flight == 0
    survivors = [r for r in (1, 2, 3) if r != victim]
    others = (4, 5)
    for ranks in (survivors, others):
        assert all(results[r][1] == tuple(ranks) for r in ranks)
        for step in range(steps):
            assert all(torch.equal(results[r][2][step], results[ranks[0]][2][step]) for r in ranks), step
    assert all(results[r][3] == [victim] for r in survivors) and all(results[r][3] == [] for r in others)
    # pushes: group 2's leader 4 at steps 2, 5, 8, 11; group 1's leader 1 until it is lost, rank 2 after
    pushed_by_1 = {2: 4, 1: 2 if where == "inside" else 1}[victim]
    assert server.clock[4] == 4 and server.clock[1] == pushed_by_1
    assert server.clock[2] == (3 if victim == 1 else 0) and server.clock[3] == 0
    assert server.updates == 4 + pushed_by_1 + server.clock[2]
    finals = [r[4] for r in results if r is not None]
    assert all(torch.equal(final, finals[0]) for final in finals)


def test_auto_decides_again_over_the_survivors_after_a_loss() -> None:
    """AUTO (windows of 3 steps, the first decision after step 2): rank 2 of 4 dies inside step 4's
    exchange. The survivors drop step 4; the window that ends after step 5 has no step timed since the
    restore, so the next one, ending after step 8, measures and decides again over 3 ranks — the world
    changed — on every survivor alike; the replicas stay bitwise equal."""
    hyper = {"measure_steps": 3, "candidates": "BSP"}
    results = elastic_run("AUTO", 4, victim=2, at=4, steps=10, hyper=hyper)
    assert results[2] is None
    survivors = [r for r in results if r is not None]
    for _, membership, steps, rule in survivors:
        assert membership.ranks == (0, 1, 3) and len(steps.recoveries) == 1
        assert [row[:2] for row in rule.decisions] == [(3, "BSP"), (9, "BSP")]
        assert rule.decision.measured.ranks == 3
    assert all(torch.equal(survivors[0][0][-1], other[0][-1]) for other in survivors[1:])


def test_in_your_own_loop_bsp_redoes_the_step_that_met_the_loss_over_the_survivors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The embedded API's BSP (one allreduce after backward): rank 2 of 3 dies right after step 3's
    allreduce completed everywhere, so both survivors meet the loss inside step 4's. Each kept its own
    step-4 gradient before the exchange (``training.run.step.kept_gradients``): they heal, put it back and
    allreduce it again over the two of them, so step 4 trains — its update is the mean of the survivors'
    own gradients, bitwise the same on both — and no step is dropped (the one line says so; it dropped
    step 4 before, a step more than torchft's survivors lose)."""
    from torch import nn

    from mpicrossbow.embed.elastic_mode import ModelState
    from mpicrossbow.embed.own_model import OwnModel
    from mpicrossbow.embed.step_hooks import StepHooks
    from mpicrossbow.training.elastic.fault_tolerance import FaultTolerance

    world, lr = FaultyWorld(3, timeout_s=20), 0.1

    def body(group: FaultyGroup) -> tuple[list[torch.Tensor], list[torch.Tensor], FaultTolerance]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        own = OwnModel(model, optimizer, lambda: None)
        comm = ElasticCommunicator(group)
        trapped = ExchangeTrap(comm)
        rule = RULES.get("BSP")().bind(trapped, own)
        tolerance = FaultTolerance(comm, rule, [ModelState(own), rule], refresh=True)
        StepHooks(own, rule, window=tolerance)
        after, local = [], []
        for step in range(7):
            data = torch.Generator().manual_seed(100 * group.me + step)
            x, y = torch.randn(16, 4, generator=data), torch.randint(0, 3, (16,), generator=data)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            local.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            if group.me == 2 and step == 3:
                trapped.arm(lambda: world.die(2))
            optimizer.step()
            after.append(own.learner.params.clone())
        return after, local, tolerance

    results = world.run(body)
    assert results[2] is None
    (after0, local0, tol0), (after1, local1, tol1) = results[0], results[1]
    for step in range(7):
        assert torch.equal(after0[step], after1[step]), step  # the replicas bitwise equal throughout
    assert not torch.equal(after0[4], after0[3])  # step 4 trained
    expected = after0[3] - lr * ((local0[4] + local1[4]) / 2)  # the mean of the survivors' own gradients
    assert torch.allclose(after0[4], expected, atol=1e-7, rtol=0), (after0[4] - expected).abs().max()
    assert tol0.committed == tol1.committed == 7 and len(tol0.recoveries) == 1
    lines = [r.getMessage() for r in caplog.records if "lost rank(s) 2" in r.getMessage()]
    assert len(lines) == 1 and "at step 4, step 4 redone over the survivors" in lines[0], lines
    assert "dropped" not in lines[0]


def test_crossbow_launchs_bsp_redoes_the_step_that_met_the_loss_over_the_survivors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The session's loop hands its window to ``train_step``: rank 2 of 4 dies right after step 3's allreduce
    completed everywhere, the survivors meet the loss in step 4's, heal, put back the gradients each kept and
    allreduce them again over the three of them: step 4 trains (not dropped, as it is when the exchange runs
    outside the window: the test above), the replicas bitwise equal after every step, one line saying so."""
    results = elastic_run("BSP", 4, victim=2, at=3, steps=8, redo=True)
    assert results[2] is None
    survivors = [r for r in results if r is not None]
    for after, membership, steps, _ in survivors:
        assert steps.redoes() and steps.saved is None  # nothing copied but the gradients
        assert not torch.equal(after[4], after[3])  # step 4 trained
        assert membership.ranks == (0, 1, 3) and len(steps.recoveries) == 1 and steps.committed == 8
    for step in range(8):
        assert all(torch.equal(r[0][step], survivors[0][0][step]) for r in survivors), step
    lines = [r.getMessage() for r in caplog.records if "lost rank(s) 2" in r.getMessage()]
    assert len(lines) == 1 and "at step 4, step 4 redone over the survivors" in lines[0], lines
