"""The StepWindow contract (training/run/window.py), bound to every implementation: the loop's one seam for
fault tolerance must run a step, a collective, a split step and the run's end the same way whichever window
the session built, as long as no rank is lost — Unguarded (a lost rank ends the job), FaultTolerance (the
elastic owner, on the fault double's ranks), RunTolerance (the owner of a crossbow-launch run), and a Drill
around each of them on a rank its drill does not target. What each does with a lost rank is theirs:
tests/test_elastic_double.py."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import OPTIM
from models.mlp import MLP
from mpicrossbow.comm.elastic import ElasticCommunicator
from mpicrossbow.config import InjectSection
from mpicrossbow.launch.world import World
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules.registry import RULES
from mpicrossbow.testing.fault_double import FaultyGroup, FaultyWorld
from mpicrossbow.training.elastic.fault_tolerance import FaultTolerance
from mpicrossbow.training.elastic.run_tolerance import RunTolerance
from mpicrossbow.training.health.drill import Drill
from mpicrossbow.training.health.faults import FaultInjector
from mpicrossbow.training.run.step import train_step
from mpicrossbow.training.run.window import StepWindow, Unguarded

RANKS = 2


def owner(group: FaultyGroup, pool: SerialPool, kind: str) -> tuple[StepWindow, Any]:
    """The window ``kind`` over ``group``'s rank, and the rule its steps run."""
    comm = ElasticCommunicator(group)
    rule = RULES.get("BSP")().bind(comm, pool)
    if kind == "unguarded":
        return Unguarded(), rule
    if kind == "fault-tolerance":
        return FaultTolerance(comm, rule, [pool, rule], every=2), rule
    world = World(group.me, RANKS, group.me, RANKS, 0, 1, "h", None)
    follower = SimpleNamespace(world=world)
    parts = SimpleNamespace(
        pool=pool, rule=rule, world=world, reporter=follower, evaluator=follower,
        checkpoints=SimpleNamespace(world=world, saver=None, position={}),
    )  # fmt: skip
    return RunTolerance(parts, comm, 1, every=2), rule  # type: ignore[arg-type]


KINDS = ["unguarded", "fault-tolerance", "run-tolerance"]


def windows(kind: str, drilled: bool) -> Callable[[FaultyGroup, SerialPool], tuple[StepWindow, Any]]:
    """A factory of ``kind``'s window, wrapped in a Drill aimed at another rank when ``drilled``."""

    def make(group: FaultyGroup, pool: SerialPool) -> tuple[StepWindow, Any]:
        window, rule = owner(group, pool, kind)
        if drilled:
            faults = FaultInjector(InjectSection(rank=RANKS + 5, step=1, action="kill"), group.me)
            window = Drill(window, faults, None)
        return window, rule

    return make


@pytest.mark.parametrize("drilled", [False, True], ids=["plain", "drilled"])
@pytest.mark.parametrize("kind", KINDS)
def test_without_a_loss_every_window_runs_the_steps_and_collectives_as_they_are(
    kind: str, drilled: bool
) -> None:
    """Four steps (two through :meth:`step`, two split into begin/guard/end as the embedded API's hooks
    split them), a collective with arguments, a flush, an amended rate, the run's end, the communicator of
    the API's own collectives (the world's: the double's group has none): every step trained
    and counted, every value returned as the callable gave it, nothing dropped; the replicas of the two
    ranks end equal (BSP), as without any window."""
    world, make = FaultyWorld(RANKS, timeout_s=20), windows(kind, drilled)

    def body(group: FaultyGroup) -> tuple[list[float], int, bool, torch.Tensor]:
        torch.manual_seed(group.me)
        pool = SerialPool(MLP(hidden=16), PoolSpec(group.me, RANKS, 8, OPTIM, torch.device("cpu"), seed=1))
        window, rule = make(group, pool)
        pool.start_epoch(0)
        before = pool.learners[0].params.clone()
        seconds = [window.step(lambda s=s: train_step(pool, rule, s) + 1.0, s) for s in range(2)]
        for s in (2, 3):
            window.begin(s)
            assert window.guard(lambda s=s: train_step(pool, rule, s), f"step {s}") is not None
            assert window.end(s)
        total = window.collective(lambda a, b: rule.comm.allreduce_scalars([a + b])[0], "a sum")(1.0, 2.0)
        assert window.flush("the end of the test")
        window.amend()
        window.on_recovery(lambda: None)
        window.settle("the end of training")
        world_mpi = object()  # a group with no MPI communicator of its own (the double): the world's
        assert window.members(world_mpi) is world_mpi
        moved = not torch.equal(before, pool.learners[0].params)
        return seconds, int(total), moved, pool.learners[0].params.clone()

    results = world.run(body)
    for seconds, total, moved, _ in results:
        assert all(s >= 1.0 for s in seconds)  # run()'s value, as it returned it
        assert total == 3 * RANKS and moved
    assert torch.equal(results[0][3], results[1][3])
