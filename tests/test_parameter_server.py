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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import launcher, only_run, run_mpi, train_steps
from models.mlp import MLP
from models.resnet import ResNet20
from mpicrossbow.comm.base import Communicator
from mpicrossbow.comm.compressed import EXACT_TAIL
from mpicrossbow.comm.inprocess import InProcessWorld
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import ASGD, BSP, EASGD, GSP, PSGD, SSP, Rule, WeedOut
from mpicrossbow.rules.grouping import group_by_speed, group_of, read_groups, read_shares
from mpicrossbow.rules.parameter_server import PUSH_HEADER, REPLY_HEADER
from mpicrossbow.training.metrics import read_metrics

LR, MOMENTUM = 0.05, 0.9
Order = Callable[[int, Sequence[int]], int]


def bn_pool(index: int, count: int) -> SerialPool:
    """A small ResNet-20 (BatchNorm running statistics among its buffers) on the digits."""
    torch.manual_seed(0)
    model = ResNet20(dataset="digits", width=4)
    return SerialPool(model, PoolSpec(index, count, 8, OptimSection(lr=LR), torch.device("cpu"), seed=1))


def make_pool(index: int, count: int, learners: int = 1) -> SerialPool:
    torch.manual_seed(0)  # the same initial replica everywhere (the server's is broadcast anyway)
    optim = OptimSection(lr=LR, momentum=MOMENTUM)
    return SerialPool(
        MLP(hidden=16), PoolSpec(index, count, 8, optim, torch.device("cpu"), seed=1, learners=learners)
    )


def run_server(
    size: int,
    steps: dict[int, int],
    make_rule: Callable[[], Rule],
    delay: dict[int, float] | None = None,
    servers: int = 1,
    learners: int = 1,
) -> dict[str, Any]:
    """Servers and workers as threads; record each worker's gradients (learners × P per step) and everyone's
    final weights."""
    workers = size - servers
    pools = [
        make_pool(0, 1, learners) if r < servers else make_pool(r - servers, workers, learners)
        for r in range(size)
    ]
    grads: dict[int, list[np.ndarray]] = {r: [] for r in range(servers, size)}
    out: dict[str, Any] = {"rules": [None] * size, "start": pools[0].learners[0].params.numpy().copy()}

    def body(comm: Communicator) -> np.ndarray:
        pool = pools[comm.rank]
        rule = out["rules"][comm.rank] = make_rule().bind(comm, pool)
        if comm.rank < servers:
            rule.serve(lambda w, epoch: None)
        else:
            grads[comm.rank] = train_steps(pool, rule, steps[comm.rank], (delay or {}).get(comm.rank, 0.0))
        rule.finish()
        rule.sync_state()
        return np.stack([learner.params.numpy().copy() for learner in pool.learners])

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
    """docs/rules.md's parameter-server SGD served in ``order``.

    ``kind``: ``ssp`` (hold while c − c_min > s; s = ∞ is ASGD), ``psgd`` (s = max_advance: once a push puts a
    worker s ahead, hold it until every other training worker pushed again), ``weedout`` (merge only pushes
    at most max(n, workers) reports old; never hold).
    """
    m = {r: len(g[0]) for r, g in grads.items()}  # learners per worker: rows of x, buf and each gradient
    x = {r: np.tile(w0.astype(np.float64), (m[r], 1)) for r in grads}
    pulled = {r: w0.astype(np.float64).copy() for r in grads}
    buf = {r: np.zeros_like(x[r]) for r in grads}
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
                w = w + scale * (x[r] - pulled[r]).sum(axis=0)
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
                x[q], pulled[q] = np.tile(w, (m[q], 1)), w.copy()
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
    "ASGD": (lambda o, **kw: ASGD(tau=TAU, order=o, **kw), "ssp", math.inf, 0, lambda k: 1.0),
    "SSP": (lambda o, **kw: SSP(tau=TAU, staleness=1, order=o, **kw), "ssp", 1, 0, lambda k: 1.0 / k),
    "PSGD": (lambda o, **kw: PSGD(tau=TAU, max_advance=2, order=o, **kw), "psgd", 2, 0, lambda k: 1.0 / k),
    "WEEDOUT": (lambda o, **kw: WeedOut(tau=TAU, n=0, order=o, **kw), "weedout", 0, 0, lambda k: 1.0 / k),
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
        train_steps(pool, rule, steps)
        return pool.learners[0].params.numpy().copy()

    bsp = InProcessWorld(2).run(bsp_body)
    np.testing.assert_allclose(ssp["final"][1][0], bsp[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ssp["final"][2][0], bsp[1], rtol=1e-5, atol=1e-6)
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
    [
        ("RULE=ASGD",),
        ("RULE=SSP", "rule.staleness=2"),
        ("RULE=PSGD",),
        ("RULE=WEEDOUT",),
        ("RULE=GSP", "rule.groups={groups}", "rule.shares={shares}"),
        ("RULE=ASGD", "rule.servers=2", "pool.learners=2"),
    ],
    ids=["ASGD", "SSP", "PSGD", "WEEDOUT", "GSP-groups-shares", "ASGD-2servers-2learners"],
)
def test_digits_job_reaches_93_percent(mpiexec: str, tmp_path: Path, rule: tuple[str, ...]) -> None:
    groups, shares = tmp_path / "groups.txt", tmp_path / "shares.txt"
    groups.write_text("1 2\n3\n")  # the slow rank 3 alone, with a smaller share of the data
    shares.write_text("0 0\n0 0.4\n0.4 0.8\n0.8 1\n")
    rule = tuple(r.format(groups=groups, shares=shares) for r in rule)
    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={tmp_path}", *rule]
    if "RULE=GSP" in rule:
        args += ["session.slow_ranks=3", "session.slow_factor=2"]
    proc = run_mpi(mpiexec, 4, args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path) / "metrics.h5")
    assert metrics["val"]["accuracy"][-1] >= 0.93, metrics["val"]["accuracy"]
    assert list(metrics["attrs"]["rank_in_flight"]) == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("name", "servers", "learners"), [("ASGD", 2, 1), ("SSP", 1, 2), ("WEEDOUT", 2, 2), ("PSGD", 3, 1)]
)
def test_sharded_servers_and_several_learners_equal_numpy(name: str, servers: int, learners: int) -> None:
    """S servers each apply their slice; a worker pushes the sum of its m learners' Δ: same equations."""
    size = 4
    steps = {r: 9 + 3 * r for r in range(servers, size)}
    make, kind, bound, n, scale = RULE_CASES[name]
    out = run_server(size, steps, lambda: make(skewed, servers=servers), servers=servers, learners=learners)
    workers = size - servers
    x, w, updates = numpy_server(
        out["start"], out["grads"], TAU, scale(workers * learners), bound, skewed, kind, n
    )
    for j in range(servers):
        server = out["rules"][j].server
        assert server.updates == updates and server.in_flight == 0
        lo, hi = out["rules"][j].bounds[j]
        assert hi - lo in (len(w) // servers, len(w) // servers + 1)
    for rank, rule in enumerate(out["rules"]):
        np.testing.assert_allclose(rule.eval_params().numpy(), w, rtol=1e-4, atol=1e-6)
        if rank >= servers:
            np.testing.assert_allclose(out["final"][rank], x[rank], rtol=1e-4, atol=1e-6)


def numpy_gsp(
    w0: np.ndarray, grads: dict[int, list[np.ndarray]], groups: list[list[int]], scale: float, order: Order
) -> tuple[dict[int, np.ndarray], np.ndarray, list[float]]:
    """docs/rules.md's GSP: a group steps on its members' mean gradient; its leader's pushes are served in
    ``order`` and applied with weight 1/Y, Y = 1 + updates since the group last pulled."""
    k = len(groups)
    x = [w0.astype(np.float64).copy() for _ in range(k)]
    pulled = [v.copy() for v in x]
    buf = [np.zeros_like(v) for v in x]
    t, seen, done = [0] * k, [0] * k, set()
    w, updates, processed, weights = w0.astype(np.float64).copy(), 0, 0, []
    while len(done) < k:
        ready = sorted(groups[i][0] for i in range(k) if i not in done)
        i = next(i for i in range(k) if groups[i][0] == order(processed, ready))
        pushed = False
        while t[i] < len(grads[groups[i][0]]):
            g = np.mean([grads[r][t[i]][0] for r in groups[i]], axis=0)
            buf[i] = MOMENTUM * buf[i] + g
            x[i] = x[i] - LR * buf[i]
            t[i] += 1
            if t[i] % TAU == 0:
                pushed = True
                break
        if pushed:
            y = 1 + updates - seen[i]
            w = w + scale / y * (x[i] - pulled[i])
            updates += 1
            weights.append(1.0 / y)
            x[i], pulled[i], seen[i] = w.copy(), w.copy(), updates
        else:
            done.add(i)
        processed += 1
    return {r: x[i] for i, g in enumerate(groups) for r in g}, w, weights


@pytest.mark.parametrize("order", [round_robin, skewed])
@pytest.mark.parametrize(("size", "groups"), [(2, [[1]]), (4, [[1, 2], [3]]), (4, [[2], [1, 3]])])
def test_gsp_equals_numpy(size: int, groups: list[list[int]], order: Order, tmp_path: Path) -> None:
    path = tmp_path / "groups.txt"
    path.write_text("# one group per line\n" + "\n".join(", ".join(map(str, g)) for g in groups) + "\n")
    leaders = {g[0] for g in groups}

    def leader_order(n: int, ready: Sequence[int]) -> int:  # a group's pushes come from its leader
        return order(n, [r for r in ready if r in leaders] or ready)

    steps = {r: 12 if len(g) > 1 else 8 for g in groups for r in g}
    out = run_server(size, steps, lambda: GSP(groups=str(path), tau=TAU, order=leader_order))
    x, w, weights = numpy_gsp(out["start"], out["grads"], groups, 1.0, leader_order)
    server = out["rules"][0].server
    np.testing.assert_allclose(server.weights, weights)
    if len(groups) > 1:  # groups overtook each other: the staleness weight really acted
        assert min(weights) < 1.0
    assert server.in_flight == 0 and server.updates == len(weights)
    for r in range(1, size):
        np.testing.assert_allclose(out["final"][r][0], x[r], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["rules"][0].w.numpy(), w, rtol=1e-4, atol=1e-6)


def test_gsp_auto_groups_put_the_straggler_alone() -> None:
    """groups = auto: after the probe the slowed worker trains in a group of its own, the others together."""
    rule = lambda: GSP(groups="auto", probe_steps=6)  # noqa: E731
    out = run_server(4, dict.fromkeys((1, 2, 3), 14), rule, delay={3: 0.05})
    for r in (1, 2, 3):
        assert out["rules"][r].group_ranks == [[1, 2], [3]]
    assert out["rules"][0].server.in_flight == 0
    np.testing.assert_allclose(out["final"][1], out["final"][2])  # one group: identical replicas


def test_group_files_and_speeds(tmp_path: Path) -> None:
    groups = tmp_path / "groups"
    groups.write_text("1 2  # fast\nnode-b\n")
    lines = read_groups(str(groups), 4, 1)
    assert group_of(lines, 2, {"node-a"}, str(groups)) == 0
    assert group_of(lines, 3, {"node-b"}, str(groups)) == 1
    with pytest.raises(ConfigError, match=r"rank 3 .* is in no group"):
        group_of(lines, 3, {"node-a"}, str(groups))
    with pytest.raises(ConfigError, match=r"rank 2 .* is in groups on lines 1 and 2"):
        group_of(lines, 2, {"node-b"}, str(groups))
    groups.write_text("0 1\n2 3\n")
    with pytest.raises(ConfigError, match="line 1: rank 0 is not a worker"):
        read_groups(str(groups), 4, 1)
    groups.write_text("1 2\n2 3\n")
    with pytest.raises(ConfigError, match="rank 2 is on lines 1 and 2"):
        read_groups(str(groups), 4, 1)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_groups(str(tmp_path / "missing"), 4, 1)
    assert group_by_speed([1.0, 1.1, 2.5], 1.5) == [0, 0, 1]
    assert group_by_speed([2.5, 1.0, 1.6], 1.5) == [2, 0, 1]
    shares = tmp_path / "shares"
    shares.write_text("0 0\n0 0.5\n0.5 1\n")
    assert read_shares(str(shares), 3, 1) == [(0.0, 0.0), (0.0, 0.5), (0.5, 1.0)]
    with pytest.raises(ConfigError, match=r"3 line\(s\) for a 2-rank job"):
        read_shares(str(shares), 2, 1)
    shares.write_text("0 0\n0.5 0.2\nx y\n")
    with pytest.raises(ConfigError, match=r"line 2: need 0 <= start < end <= 1"):
        read_shares(str(shares), 3, 1)
    with pytest.raises(ConfigError, match="shares needs a groups file"):
        GSP(groups="auto", shares=str(shares))


def test_gsp_group_with_unequal_shares_is_refused(tmp_path: Path) -> None:
    groups, shares = tmp_path / "groups", tmp_path / "shares"
    groups.write_text("1 2\n")
    shares.write_text("0 0\n0 0.2\n0.2 1\n")
    pools = [make_pool(0, 1)] + [
        SerialPool(MLP(hidden=16), PoolSpec(r - 1, 2, 8, OptimSection(), torch.device("cpu"), span=span))
        for r, span in ((1, (0.0, 0.2)), (2, (0.2, 1.0)))
    ]

    def body(comm: Communicator) -> str:
        try:
            GSP(groups=str(groups), shares=str(shares)).bind(comm, pools[comm.rank])
        except ConfigError as exc:
            return str(exc)
        return ""

    errors = InProcessWorld(3, timeout_s=30).run(body)
    assert errors[0] == "" and all("batches per epoch" in e for e in errors[1:]), errors


def test_message_headers_travel_exactly_under_compression() -> None:
    """Flags, progress and counters ride at the end of push and reply messages: within the compressed
    communicator's bit-exact tail, so bf16 never rounds a count."""
    assert max(PUSH_HEADER, REPLY_HEADER) <= EXACT_TAIL


def test_servers_validate_with_the_workers_batchnorm_statistics() -> None:
    """A server never runs forward: after sync_state its model carries the workers' mean BatchNorm buffers,
    not the statistics it was initialised with."""
    pools = [bn_pool(0, 1), bn_pool(0, 2), bn_pool(1, 2)]
    initial = pools[0].learners[0].buffers.clone()

    def body(comm: Communicator) -> torch.Tensor:
        pool = pools[comm.rank]
        rule = ASGD().bind(comm, pool)
        if comm.rank == 0:
            rule.serve(lambda w, epoch: None)
        else:
            train_steps(pool, rule, 3)
        trained = pool.learners[0].buffers.clone()
        rule.finish()
        rule.sync_state()
        return trained if comm.rank else pool.learners[0].buffers.clone()

    server, *workers = InProcessWorld(3, timeout_s=60).run(body)
    assert not torch.equal(workers[0], initial)
    torch.testing.assert_close(pools[0].learners[0].buffers, (workers[0] + workers[1]) / 2)
    torch.testing.assert_close(server, (workers[0] + workers[1]) / 2)


@pytest.mark.parametrize("rule_name", ["ASGD", "EASGD async"])
def test_the_served_model_is_reported_with_the_workers_batchnorm_statistics(rule_name: str) -> None:
    """The once-per-epoch report of the served model (ASGD's server, async EASGD's centre) validates it
    with the workers' latest BatchNorm statistics, which ride on their pushes: with the server's own initial
    statistics a ResNet's served model reads as chance until the run ends."""
    pools = [bn_pool(0, 1), bn_pool(0, 2), bn_pool(1, 2)]
    initial = pools[0].learners[0].buffers.clone()
    reported: list[tuple[float, torch.Tensor]] = []

    def body(comm: Communicator) -> torch.Tensor:
        pool = pools[comm.rank]
        rule = (ASGD() if rule_name == "ASGD" else EASGD(mode="async")).bind(comm, pool)
        if comm.rank == 0:
            rule.serve(lambda w, epoch: reported.append((epoch, pool.learners[0].buffers.clone())))
        else:
            train_steps(pool, rule, pool.n_batch_train)  # exactly one epoch: the report comes at its end
        trained = pool.learners[0].buffers.clone()
        rule.finish()
        return trained

    _, *workers = InProcessWorld(3, timeout_s=120).run(body)
    ((epoch, stats),) = reported
    assert epoch == 1.0
    assert not torch.equal(stats, initial)
    torch.testing.assert_close(stats, (workers[0] + workers[1]) / 2)
