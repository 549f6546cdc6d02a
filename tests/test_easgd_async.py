"""Asynchronous EASGD (``mode = async``): rank 0 serves the centre, ranks 1..N-1 train.

* A differential test at world sizes 2 and 4: the server answers in a fixed order (the ``order`` test hook,
  which blocks on one worker at a time), every worker's gradients are recorded, and numpy replays
  docs/rules.md's asynchronous equations with those gradients in that order. Size 1 has no worker (rank 0
  only serves) and is rejected with a ConfigError.
* Termination with uneven worker speeds, in arrival order: every rank returns, the slow worker does not hold
  the fast one, every posted receive was consumed and every message received (nothing in flight).
* Bad hyper-parameters: a ConfigError naming the key.
* One real ``mpiexec`` job per world size (1 server + 1 worker, 1 server + 3 workers) on the digits cfg.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import run_mpi, train_steps
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.comm.inprocess import InProcessCommunicator, InProcessWorld
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import EASGD
from mpicrossbow.training.metrics import read_metrics

LR, MOMENTUM, TAU = 0.05, 0.9, 3
Order = Callable[[int, Sequence[int]], int]


def make_pools(size: int, hidden: int = 16, learners: int = 1) -> list[SerialPool]:
    """Rank 0's pool on the whole set (it serves, as the session builds it); workers share the data."""
    optim = OptimSection(lr=LR, momentum=MOMENTUM)
    pools = []
    for r in range(size):
        torch.manual_seed(r)
        index, count = (0, 1) if r == 0 else EASGD(mode="async").train_shard(r, size)
        pools.append(
            SerialPool(
                MLP(hidden=hidden),
                PoolSpec(index, count, 8, optim, torch.device("cpu"), seed=1, learners=learners),
            )
        )
    return pools


def run_async(
    size: int,
    steps: dict[int, int],
    order: Order | None,
    hyper: dict[str, Any],
    delay: dict[int, float] | None = None,
    hidden: int = 16,
    learners: int = 1,
) -> dict[str, Any]:
    """Run the server and the workers as threads; record gradients, results, reports and channel state.

    A worker's recorded gradient at a step is an array [learners, n]; results hold [learners, n] weights.
    """
    pools = make_pools(size, hidden, learners)
    grads: dict[int, list[np.ndarray]] = {r: [] for r in range(1, size)}
    out: dict[str, Any] = {"reports": [], "finished": {}, "rules": [None] * size, "pools": pools}

    def report(centre: torch.Tensor, epoch: float) -> None:
        out["reports"].append((epoch, centre.numpy().copy()))

    def body(comm: Communicator) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
        pool = pools[comm.rank]
        rule = EASGD(mode="async", order=order, **hyper)
        assert not rule.synchronous and rule.trains(comm.rank, comm.size) == (comm.rank != 0)
        out["rules"][comm.rank] = rule.bind(comm, pool)
        if comm.rank == 0:
            out["start"] = pool.learners[0].params.numpy().copy()
            rule.serve(report)
        else:
            grads[comm.rank] = train_steps(pool, rule, steps[comm.rank], (delay or {}).get(comm.rank, 0.0))
        rule.finish()
        out["finished"][comm.rank] = time.monotonic()
        before_sync = rule.eval_params()
        centre = rule.centre.numpy().copy()  # the server's is final here; a worker's is still the initial one
        rule.sync_state()
        comm.barrier()
        if comm.rank == 0:
            assert isinstance(comm, InProcessCommunicator)
            group = comm._group  # every message sent was received, every receive posted was matched
            out["channels"] = {ch: (group.posted[ch], list(group.mail[ch])) for ch in set(group.mail)}
        return np.stack([lr.params.numpy().copy() for lr in pool.learners]), centre, before_sync

    out["results"] = InProcessWorld(size).run(body)
    out["grads"] = grads
    return out


def numpy_async_easgd(
    w0: np.ndarray,
    grads: dict[int, list[np.ndarray]],
    alpha: float,
    tau: int,
    nesterov: bool,
    order: Order,
) -> tuple[dict[int, np.ndarray], np.ndarray, int]:
    """docs/rules.md's asynchronous EASGD with the recorded gradients, requests served in ``order``.

    A worker's weights are [learners, n]; one request serves its learners one after another.
    """
    x = {r: np.stack([w0.astype(np.float64)] * len(grads[r][0])) for r in grads}
    buf = {r: np.zeros_like(x[r]) for r in grads}
    t = dict.fromkeys(grads, 0)
    centre = w0.astype(np.float64).copy()

    def advance(r: int) -> bool:
        """Local steps of worker r up to its next request (True) or its done message (False)."""
        while t[r] < len(grads[r]):
            g = grads[r][t[r]]  # torch SGD: buf ← μ buf + g; step g + μ buf (Nesterov) or buf
            buf[r] = MOMENTUM * buf[r] + g
            x[r] = x[r] - LR * (g + MOMENTUM * buf[r] if nesterov else buf[r])
            t[r] += 1
            if t[r] % tau == 0:
                return True
        return False

    active, processed, updates = sorted(grads), 0, 0
    while active:
        r = order(processed, list(active))
        if advance(
            r
        ):  # the worker reads x~, computes e = α (x_i − x~), x_i ← x_i − e; the server x~ ← x~ + e
            for j in range(len(x[r])):
                e = alpha * (x[r][j] - centre)
                x[r][j] = x[r][j] - e
                centre = centre + e
                updates += 1
        else:
            active.remove(r)
        processed += 1
    return x, centre, updates


def round_robin(n: int, active: Sequence[int]) -> int:
    """Block on the workers in turn."""
    return active[n % len(active)]


def skewed(n: int, active: Sequence[int]) -> int:
    """A less regular fixed schedule: the last active worker is served twice as often."""
    return active[-1] if n % 3 == 2 else active[(n // 3) % len(active)]


def assert_nothing_in_flight(out: dict[str, Any]) -> None:
    server = out["rules"][0].server
    assert server.in_flight == 0
    assert out["channels"], "no message was exchanged"
    for channel, (posted, mail) in out["channels"].items():
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
    out = run_async(size, steps, order, hyper, learners=learners)
    alpha = 0.9 / ((size - 1) * learners)  # default α = 0.9/k, k = the worker learners
    x, centre, updates = numpy_async_easgd(out["start"], out["grads"], alpha, TAU, eamsgd, order)
    results = out["results"]
    np.testing.assert_allclose(results[0][1], centre, rtol=1e-4, atol=1e-6)
    for r in range(1, size):
        np.testing.assert_allclose(results[r][0], x[r], rtol=1e-4, atol=1e-6)
        assert results[r][2] is None  # a worker has no centre to validate before sync_state
        assert out["rules"][r].worker.requests == learners * (steps[r] // TAU)
    for rule in out["rules"]:  # after sync_state every rank validates the server's final centre
        np.testing.assert_allclose(rule.eval_params().numpy(), centre, rtol=1e-4, atol=1e-6)
    assert out["rules"][0].server.updates == updates == learners * sum(s // TAU for s in steps.values())
    assert out["rules"][0].state_dict()["updates"] == updates
    assert_nothing_in_flight(out)


def test_uneven_workers_terminate_with_nothing_in_flight() -> None:
    """Arrival order: a slow worker (20 ms a step) does not hold a fast one; every rank returns."""
    steps = {1: 40, 2: 150, 3: 7}
    out = run_async(4, steps, None, {"tau": 5}, delay={1: 0.02}, hidden=8)
    assert out["finished"][2] < out["finished"][1]  # the fast worker finished first
    assert set(out["finished"]) == {0, 1, 2, 3}
    assert_nothing_in_flight(out)
    server = out["rules"][0].server
    assert server.updates == sum(s // 5 for s in steps.values())
    per_epoch = {r: out["pools"][r].n_batch_train for r in steps}
    epochs = sum(steps[r] / per_epoch[r] for r in steps) / 3
    assert server.epoch == pytest.approx(epochs, rel=1e-5)
    assert [math.floor(e) for e, _ in out["reports"]] == list(range(1, math.floor(epochs) + 1))
    centres = {tuple(np.round(r.eval_params().numpy()[:5], 6)) for r in out["rules"]}
    assert len(centres) == 1  # the broadcast centre everywhere


def test_one_rank_has_no_worker() -> None:
    """Rank 0 only serves, so async EASGD needs a second rank; sync EASGD runs on one rank."""
    rule = EASGD(mode="async")
    with pytest.raises(ConfigError, match=r"\[rule\] mode = async needs at least 2 ranks.*this job has 1"):
        rule.trains(0, 1)
    assert EASGD().trains(0, 1) and EASGD().train_shard(0, 1) == (0, 1)
    assert [rule.train_shard(r, 4) for r in (1, 2, 3)] == [(0, 3), (1, 3), (2, 3)]
    pool = make_pools(1)[0]
    with pytest.raises(ConfigError, match="mode = async"):
        InProcessWorld(1).run(lambda comm: EASGD(mode="async").bind(comm, pool))


@pytest.mark.parametrize(
    ("hyper", "message"),
    [
        ({"mode": "gossip"}, r"\[rule\] mode: 'gossip' is not valid; choose one of sync, async"),
        ({"mode": "async", "tau": 0}, r"\[rule\] tau: 0 is out of range; must be >= 1"),
        ({"mode": "async", "alpha": 0}, r"\[rule\] alpha: 0.0 is out of range; must be > 0"),
        ({"mode": "async", "alpha": 1.5}, r"\[rule\] alpha: 1.5 is out of range; must be <= 1"),
        ({"mode": "async", "momentum": 1}, r"\[rule\] momentum: 1.0 is out of range; must be < 1"),
        (
            {"mode": "async", "rate": 0.1},
            r"\[rule\] unknown key 'rate'; valid keys: mode, alpha, tau, momentum",
        ),
    ],
)
def test_bad_hyper_parameters_name_the_key(hyper: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EASGD(**hyper)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_async_easgd_job_reaches_93_percent(mpiexec: str, tmp_path: Path, ranks: int) -> None:
    """1 server + 1 worker, 1 server + 3 workers: exit 0, ≥ 93 % on the whole validation set."""
    script = Path(sys.executable).parent / "crossbow-launch"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "mpicrossbow.cli"]
    args = ["-cfg", "launch/digits.cfg", "RULE=EASGD", "rule.mode=async", f"session.output={tmp_path}"]
    proc = run_mpi(mpiexec, ranks, [*launcher, *args], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    metrics = read_metrics(run / "metrics.h5")
    accuracy = metrics["val"]["accuracy"]
    assert accuracy[-1] >= 0.93, accuracy
    assert len(accuracy) >= 20  # the server reported the centre about once per epoch, then the final model
    assert metrics["attrs"]["world_size"] == ranks
    assert "EASGD server:" in proc.stderr and "all done" in proc.stderr
