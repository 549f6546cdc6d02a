"""ASGD and SSP through the parameter server, against numpy, against BSP, and in real MPI jobs.

* Differential tests at world sizes 2 and 4: the server waits for pushes in a fixed order (the ``order``
  test hook), every worker's gradients are recorded, and numpy replays the server's equations (``w ← w +
  scale·Δ``, SSP's held replies while ``c − c_min > s``) with those gradients in that order.
* SSP with s = 0 (τ = 1, scale 1/workers) trains exactly as BSP gradient mode on the same batches.
* Uneven workers terminate with nothing in flight; bad hyper-parameters name the key.
* One real ``mpiexec -n 4`` digits job per rule: ≥ 93 %, nothing in flight at exit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import launcher, only_run, run_mpi
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.comm.inprocess import InProcessWorld
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.metrics import read_metrics
from mpicrossbow.pool import SerialPool
from mpicrossbow.rules import ASGD, BSP, PSGD, SSP, Rule, WeedOut

LR, MOMENTUM = 0.05, 0.9
Order = Callable[[int, Sequence[int]], int]


def make_pool(index: int, count: int) -> SerialPool:
    torch.manual_seed(0)  # the same initial replica everywhere (the server's is broadcast anyway)
    optim = OptimSection(lr=LR, momentum=MOMENTUM)
    return SerialPool(MLP(hidden=16), index, count, 8, optim, torch.device("cpu"), seed=1)


def run_server(
    size: int, steps: dict[int, int], make_rule: Callable[[], Rule], delay: dict[int, float] | None = None
) -> dict[str, Any]:
    """Server and workers as threads; record each worker's gradients and everyone's final weights."""
    pools = [make_pool(0, 1) if r == 0 else make_pool(r - 1, size - 1) for r in range(size)]
    grads: dict[int, list[np.ndarray]] = {r: [] for r in range(1, size)}
    out: dict[str, Any] = {"rules": [None] * size, "start": pools[0].learners[0].params.numpy().copy()}

    def body(comm: Communicator) -> np.ndarray:
        pool = pools[comm.rank]
        rule = out["rules"][comm.rank] = make_rule().bind(comm, pool)
        if comm.rank == 0:
            rule.serve(lambda w, epoch: None)
        else:
            per_epoch = pool.n_batch_train
            for step in range(steps[comm.rank]):
                if step % per_epoch == 0:
                    pool.start_epoch(step // per_epoch)
                pool.compute(step % per_epoch)
                grads[comm.rank].append(pool.learners[0].grads.numpy().copy())
                rule.on_gradients(step)
                pool.apply()
                rule.exchange(step)
                time.sleep((delay or {}).get(comm.rank, 0.0))
        rule.finish()
        rule.sync_state()
        return pool.learners[0].params.numpy().copy()

    out["final"] = InProcessWorld(size, timeout_s=60).run(body)
    out["grads"] = grads
    return out


def numpy_server(
    w0: np.ndarray,
    grads: dict[int, list[np.ndarray]],
    tau: int,
    scale: float,
    s: float,
    order: Order,
    kind: str = "ssp",
    n: int = 0,
) -> tuple[dict[int, np.ndarray], np.ndarray, int]:
    """ALGORITHMS.md's parameter-server SGD served in ``order``.

    ``kind``: ``ssp`` (hold while c − c_min > s; s = ∞ is ASGD), ``psgd`` (s = max_advance: once a push puts a
    worker s ahead, hold it until every other training worker pushed again), ``weedout`` (merge only pushes
    at most max(n, workers) reports old; never hold).
    """
    x = {r: w0.astype(np.float64).copy() for r in grads}
    pulled = {r: x[r].copy() for r in grads}
    buf = {r: np.zeros_like(w0, dtype=np.float64) for r in grads}
    t, clock = dict.fromkeys(grads, 0), dict.fromkeys(grads, 0)
    w, held, done, processed, updates = w0.astype(np.float64).copy(), set(), set(), 0, 0
    received, pulled_at, waits = 0, dict.fromkeys(grads, 0), {}

    def advance(r: int) -> bool:
        while t[r] < len(grads[r]):
            buf[r] = MOMENTUM * buf[r] + grads[r][t[r]]
            x[r] = x[r] - LR * buf[r]
            t[r] += 1
            if t[r] % tau == 0:
                return True
        return False

    while len(done) < len(grads):
        ready = sorted(r for r in grads if r not in done and r not in held)
        r = order(processed, ready)
        if advance(r):
            received += 1
            if kind != "weedout" or received - pulled_at[r] <= max(n, len(grads)):
                w = w + scale * (x[r] - pulled[r])
                updates += 1
            clock[r] += 1
            active = [clock[q] for q in grads if q not in done]
            if kind == "psgd" and clock[r] - min(active) >= s:
                waits[r] = {q: clock[q] for q in grads if q != r}
            held.add(r)
        else:
            done.add(r)
        active = [clock[q] for q in grads if q not in done]
        c_min = min(active) if active else math.inf
        for q in sorted(held):
            if kind == "ssp":
                free = clock[q] <= c_min + s
            elif kind == "psgd":
                free = q not in waits or all(p in done or clock[p] > c for p, c in waits[q].items())
            else:
                free = True
            if free:
                held.discard(q)
                waits.pop(q, None)
                x[q], pulled[q] = w.copy(), w.copy()
                pulled_at[q] = received
        processed += 1
    return x, w, updates


def round_robin(n: int, ready: Sequence[int]) -> int:
    """Serve the ready workers in turn."""
    return ready[n % len(ready)]


def last_first(n: int, ready: Sequence[int]) -> int:
    """An irregular order: the highest ready worker twice as often."""
    return ready[-1] if n % 3 != 1 else ready[0]


def skewed(n: int, ready: Sequence[int]) -> int:
    """Serve the last ready worker three times for each other one: it runs ahead, the rest fall behind."""
    return ready[-1] if n % 4 else ready[0]


TAU = 2
RULE_CASES = {  # name: (factory, numpy kind, bound, n, scale as a function of the worker count)
    "ASGD": (lambda o: ASGD(tau=TAU, order=o), "ssp", math.inf, 0, lambda k: 1.0),
    "SSP": (lambda o: SSP(tau=TAU, staleness=1, order=o), "ssp", 1, 0, lambda k: 1.0 / k),
    "PSGD": (lambda o: PSGD(tau=TAU, max_advance=2, order=o), "psgd", 2, 0, lambda k: 1.0 / k),
    "WEEDOUT": (lambda o: WeedOut(tau=TAU, n=0, order=o), "weedout", 0, 0, lambda k: 1.0 / k),
}


@pytest.mark.parametrize("order", [round_robin, last_first, skewed])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(RULE_CASES))
def test_parameter_server_rules_equal_numpy(name: str, size: int, order: Order) -> None:
    steps = {r: 9 + 3 * r for r in range(1, size)}  # uneven lengths: bounds and weed-out really act
    make, kind, bound, n, scale = RULE_CASES[name]
    out = run_server(size, steps, lambda: make(order))
    x, w, updates = numpy_server(out["start"], out["grads"], TAU, scale(size - 1), bound, order, kind, n)
    server = out["rules"][0].server
    assert server.updates == updates
    assert server.updates + server.discarded == sum(k // TAU for k in steps.values())
    if size == 4 and order is skewed:  # the fast worker runs ahead: each rule's mechanism really acted
        assert (server.holds > 0) == (name in ("SSP", "PSGD"))
        assert (server.discarded > 0) == (name == "WEEDOUT")
    assert server.in_flight == 0
    np.testing.assert_allclose(out["rules"][0].w.numpy(), w, rtol=1e-4, atol=1e-6)
    for r in range(1, size):
        np.testing.assert_allclose(out["final"][r], x[r], rtol=1e-4, atol=1e-6)
    for rule in out["rules"]:  # after sync_state every rank holds the server's w
        np.testing.assert_allclose(rule.eval_params().numpy(), w, rtol=1e-4, atol=1e-6)


def test_ssp_with_zero_staleness_is_bsp() -> None:
    """s = 0, τ = 1, scale 1/workers: N workers through the server train exactly as BSP on N ranks."""
    steps = 8
    ssp = run_server(3, {1: steps, 2: steps}, lambda: SSP(staleness=0, tau=1))

    pools = [make_pool(r, 2) for r in range(2)]  # built here: torch's global seed is not thread-safe

    def bsp_body(comm: Communicator) -> np.ndarray:
        pool = pools[comm.rank]
        rule = BSP(mode="grad").bind(comm, pool)
        pool.start_epoch(0)
        for step in range(steps):
            pool.compute(step)
            rule.on_gradients(step)
            pool.apply()
            rule.exchange(step)
        return pool.learners[0].params.numpy().copy()

    bsp = InProcessWorld(2).run(bsp_body)
    np.testing.assert_allclose(ssp["final"][1], bsp[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ssp["final"][2], bsp[1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(bsp[0], ssp["start"])


def test_uneven_workers_terminate_with_nothing_in_flight() -> None:
    out = run_server(4, {1: 30, 2: 60, 3: 5}, lambda: SSP(staleness=2, tau=3), delay={1: 0.01})
    server = out["rules"][0].server
    assert server.in_flight == 0 and server.done == {1, 2, 3}
    assert server.updates == 30 // 3 + 60 // 3 + 5 // 3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SSP(staleness=-1), r"\[rule\] staleness: -1 is out of range; must be >= 0"),
        (lambda: ASGD(tau=0), r"\[rule\] tau: 0 is out of range; must be >= 1"),
        (lambda: ASGD(scale=-1), r"\[rule\] scale: -1.0 is out of range; must be >= 0"),
    ],
)
def test_bad_hyper_parameters_name_the_key(make: Callable[[], Rule], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()


def test_one_rank_is_not_enough() -> None:
    with pytest.raises(ConfigError, match="needs at least 2 ranks"):
        SSP().trains(0, 1)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "rule",
    [("RULE=ASGD",), ("RULE=SSP", "rule.staleness=2"), ("RULE=PSGD",), ("RULE=WEEDOUT",)],
    ids=["ASGD", "SSP", "PSGD", "WEEDOUT"],
)
def test_digits_job_reaches_93_percent(mpiexec: str, tmp_path: Path, rule: tuple[str, ...]) -> None:
    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={tmp_path}", *rule]
    proc = run_mpi(mpiexec, 4, args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path) / "metrics.h5")
    assert metrics["val"]["accuracy"][-1] >= 0.93, metrics["val"]["accuracy"]
    assert list(metrics["attrs"]["rank_in_flight"]) == [0, 0, 0, 0]
