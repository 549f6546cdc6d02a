"""Asynchronous EASGD (``mode = async``): rank 0 serves the centre, ranks 1..N-1 train.

* A differential test at world sizes 2 and 4: the server answers in a fixed order (the ``order`` test hook,
  which blocks on one worker at a time), every worker's gradients are recorded, and numpy replays the
  asynchronous equations (docs/rules.md, tests/reference.py) with those gradients in that order. Size 1 has no
  worker (rank 0 only serves) and is rejected with a ConfigError.
* Termination with uneven worker speeds, in arrival order: every rank returns, the slow worker does not hold
  the fast one, every posted receive was consumed and every message received (nothing in flight).
* Hyper-parameter errors are the rule contract's (tests/test_rule_contract.py).
* A real ``mpiexec -n 2`` job (1 server + 1 worker) on the digits cfg; 1 server + 3 workers is a run of
  tests/test_digits_rules_mpi.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import reference
from conftest import LR, MOMENTUM, WorldRun, launcher, only_run, run_mpi, run_world
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import EASGD, Rule
from mpicrossbow.testing import InProcessCommunicator, InProcessWorld
from mpicrossbow.training.reporting.metrics import read_metrics

TAU = 3
Order = Callable[[int, Sequence[int]], int]


@dataclass
class Finished:
    """One rank right after ``finish``: when, what it would validate, its centre, its communicator."""

    at: float
    before_sync: torch.Tensor | None
    centre: np.ndarray
    comm: Communicator


def finished(comm: Communicator, pool: LearnerPool, rule: Rule) -> Finished:
    """``run_world``'s ``after_finish`` (the server's centre is final here, a worker's still the initial)."""
    assert isinstance(rule, EASGD)
    return Finished(time.monotonic(), rule.eval_params(), rule.centre.numpy().copy(), comm)


def run_async(
    size: int,
    steps: dict[int, int],
    order: Order | None,
    hyper: dict[str, Any],
    sleep_s: dict[int, float] | None = None,
    hidden: int = 16,
    learners: int = 1,
) -> tuple[WorldRun, list[tuple[float, np.ndarray]]]:
    """Run the server and the workers as threads; return the run and the centres the server reported."""
    reports: list[tuple[float, np.ndarray]] = []
    out = run_world(
        size,
        lambda: EASGD(mode="async", order=order, **hyper),
        steps,
        model=lambda: MLP(hidden=hidden),
        learners=learners,
        sleep_s=sleep_s,
        report=lambda pool, centre, epoch: reports.append((epoch, centre.numpy().copy())),
        after_finish=finished,
    )
    return out, reports


def round_robin(n: int, active: Sequence[int]) -> int:
    """Block on the workers in turn."""
    return active[n % len(active)]


def skewed(n: int, active: Sequence[int]) -> int:
    """A less regular fixed schedule: the last active worker is served twice as often."""
    return active[-1] if n % 3 == 2 else active[(n // 3) % len(active)]


def assert_nothing_in_flight(out: WorldRun) -> None:
    """The server has nothing outstanding, and every message sent was received, every receive posted was
    matched (the in-process world's mailboxes, after every rank's ``sync_state``)."""
    assert out.rules[0].server.in_flight == 0
    comm = out.extra[0].comm
    assert isinstance(comm, InProcessCommunicator)
    group = comm._group
    channels = {ch: (group.posted[ch], list(group.mail[ch])) for ch in set(group.mail)}
    assert channels, "no message was exchanged"
    for channel, (posted, mail) in channels.items():
        assert posted == len(mail), (
            f"channel {channel}: {posted} receive(s) posted for {len(mail)} message(s)"
        )
        assert all(m is None for m in mail), f"channel {channel}: a message was never received"


@pytest.mark.parametrize(
    ("size", "eamsgd", "order", "learners"),
    [
        (2, False, round_robin, 1),
        (2, True, round_robin, 1),
        (4, False, skewed, 1),
        (4, True, round_robin, 1),
        (3, False, skewed, 2),
        (2, True, round_robin, 3),
    ],
)
def test_async_easgd_equals_numpy(size: int, eamsgd: bool, order: Order, learners: int) -> None:
    steps = {r: 10 + 2 * r for r in range(1, size)}  # uneven: requests after 3, 6, 9, (12); done at the end
    hyper = {"tau": TAU, "momentum": MOMENTUM} if eamsgd else {"tau": TAU}
    out, _ = run_async(size, steps, order, hyper, learners=learners)
    alpha = 0.9 / ((size - 1) * learners)  # default α = 0.9/k, k = the worker learners
    sgd = reference.Sgd(LR, MOMENTUM, nesterov=eamsgd)
    x, centre, updates = reference.easgd_async(out.w0, out.worker_grads(), sgd, alpha, TAU, order)
    np.testing.assert_allclose(out.extra[0].centre, centre, rtol=1e-4, atol=1e-6)
    for r in range(1, size):
        np.testing.assert_allclose(out.final[r], x[r], rtol=1e-4, atol=1e-6)
        assert out.extra[r].before_sync is None  # a worker has no centre to validate before sync_state
        assert out.rules[r].worker.requests == learners * (steps[r] // TAU)
    for rule in out.rules:  # after sync_state every rank validates the server's final centre
        np.testing.assert_allclose(rule.eval_params().numpy(), centre, rtol=1e-4, atol=1e-6)
    assert out.rules[0].server.updates == updates == learners * sum(s // TAU for s in steps.values())
    assert out.rules[0].served == sum(s // TAU for s in steps.values())  # requests: [inject]'s clock
    assert out.rules[0].state_dict()["updates"] == updates
    assert_nothing_in_flight(out)


def test_uneven_workers_terminate_with_nothing_in_flight() -> None:
    """Arrival order: a slow worker (20 ms a step) does not hold a fast one; every rank returns."""
    steps = {1: 40, 2: 150, 3: 7}
    out, reports = run_async(4, steps, None, {"tau": 5}, sleep_s={1: 0.02}, hidden=8)
    assert out.extra[2].at < out.extra[1].at  # the fast worker finished first
    assert_nothing_in_flight(out)
    server = out.rules[0].server
    assert server.updates == sum(s // 5 for s in steps.values())
    per_epoch = {r: out.pools[r].n_batch_train for r in steps}
    epochs = sum(steps[r] / per_epoch[r] for r in steps) / 3
    assert server.epoch == pytest.approx(epochs, rel=1e-5)
    assert [math.floor(e) for e, _ in reports] == list(range(1, math.floor(epochs) + 1))
    centres = {tuple(np.round(r.eval_params().numpy()[:5], 6)) for r in out.rules}
    assert len(centres) == 1  # the broadcast centre everywhere


def test_one_rank_has_no_worker() -> None:
    """Rank 0 only serves, so async EASGD needs a second rank (the rule contract's world-size table checks
    the message); sync EASGD runs on one rank."""
    rule = EASGD(mode="async")
    assert not rule.synchronous and [rule.trains(r, 4) for r in range(4)] == [False, True, True, True]
    assert EASGD().trains(0, 1) and EASGD().train_shard(0, 1) == (0, 1)
    assert [rule.train_shard(r, 4) for r in (1, 2, 3)] == [(0, 3), (1, 3), (2, 3)]
    pool = SerialPool(MLP(hidden=8), PoolSpec(0, 1, 8, OptimSection(), torch.device("cpu")))
    with pytest.raises(ConfigError, match="mode = async"):
        InProcessWorld(1).run(lambda comm: EASGD(mode="async").bind(comm, pool))


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2])
def test_async_easgd_job_reaches_93_percent(mpiexec: str, tmp_path: Path, ranks: int) -> None:
    """1 server + 1 worker: exit 0, ≥ 93 % on the whole validation set (1 server + 3 workers is a run of
    tests/test_digits_rules_mpi.py's one launch)."""
    args = ["-cfg", "launch/digits.cfg", "RULE=EASGD", "rule.mode=async", f"session.output={tmp_path}"]
    proc = run_mpi(mpiexec, ranks, [*launcher(), *args], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path) / "metrics.h5")
    accuracy = metrics["val"]["accuracy"]
    assert accuracy[-1] >= 0.93, accuracy
    assert len(accuracy) >= 20  # the server reported the centre about once per epoch, then the final model
    assert metrics["attrs"]["world_size"] == ranks
    assert "EASGD server:" in proc.stderr and "all done" in proc.stderr


@pytest.mark.parametrize(("alpha", "after"), [(None, 0.9 / 4), (0.1, 0.1)])
def test_a_lost_worker_moves_a_default_alpha_to_the_live_workers(alpha: float | None, after: float) -> None:
    """Elastic training: the centre forgets a lost worker; α left to its default (β / k, β = 0.9, k the
    workers' learners: 3 workers × 2 learners) becomes β over the live workers' learners (2 × 2), so the
    centre's pull per unit of time stays; an explicit α stays as set. The worker applies the e = α(x − x~)
    the centre sends, so α changes on both sides at once."""
    out, _ = run_async(4, {1: 4, 2: 4, 3: 4}, round_robin, {"tau": 1, "alpha": alpha}, learners=2)
    server = out.rules[0].server
    assert server.alpha == pytest.approx(0.9 / 6 if alpha is None else alpha)
    server.forget(2)
    server.forget(2)  # a second meeting of the same loss changes nothing
    assert server.alpha == pytest.approx(after) and server.lost == {2}
