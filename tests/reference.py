"""Plain-numpy references of every rule's update equations (docs/rules.md), for the differential tests.

Each function replays one rule from the initial weights ``w0`` and the gradients the framework's learners
recorded at every step (the gradients were taken at the framework's own weights, which the reference
reproduces step by step), in float64. Equal weights after the run mean the framework computes exactly the
equations. Nothing here imports torch or mpicrossbow: the references stand apart from what they check.

Shapes: a synchronous rule's ``grads[g][t]`` is learner g's flat gradient at step t (learners rank-major:
learner j of rank r is ``r·m + j``); a server rule's ``grads[r][t]`` is worker rank r's ``(m, P)`` array
of its m learners' gradients at step t. ``order(n, ready)`` names the ready worker (or group leader) whose
message the server takes n-th: the tests' fixed arrival orders.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: One learner's (or one worker's ``(m, P)``) gradient at every step.
Steps = Sequence[np.ndarray]
Grads = Sequence[Steps]
Order = Callable[[int, Sequence[int]], int]

#: GOSGD's gossip weights are integers in units of 2⁻⁵², so halving and merging them is exact.
UNIT = 2**52


@dataclass(frozen=True)
class Sgd:
    """``torch.optim.SGD``'s local step (dampening 0), with b the momentum buffer (0 before the first step):

    ``g ← g + λ w;  b ← μ b + g;  w ← w − η (g + μ b)`` (Nesterov) or ``w ← w − η b``.
    """

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def step(self, w: np.ndarray, buf: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(w, b)`` after one step on gradient ``g``."""
        g = g + self.weight_decay * w
        buf = self.momentum * buf + g
        return w - self.lr * (g + self.momentum * buf if self.nesterov else buf), buf


def _replicas(w0: np.ndarray, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """k float64 copies of ``w0`` and k zero momentum buffers."""
    w = [w0.astype(np.float64) for _ in range(k)]
    return w, [np.zeros_like(w[0]) for _ in range(k)]


def _local_steps(w: list[np.ndarray], buf: list[np.ndarray], grads: Grads, t: int, sgd: Sgd) -> None:
    """Every learner's local step t, in place on the lists."""
    for j in range(len(w)):
        w[j], buf[j] = sgd.step(w[j], buf[j], grads[j][t])


def sma(
    w0: np.ndarray, grads: Grads, sgd: Sgd, alpha: float, mu: float
) -> tuple[list[np.ndarray], np.ndarray]:
    """SMA (Crossbow): each step, with w_j from before the local step,

    ``c_j = α (w_j − z_t);  w_j ← local step(w_j) − c_j;  z_{t+1} = z_t + Σ_j c_j + μ (z_t − z_{t−1})``.

    Returns every learner's weights and z.
    """
    w, buf = _replicas(w0, len(grads))
    z = z_prev = w[0].copy()
    for t in range(len(grads[0])):
        c = [alpha * (x - z) for x in w]
        _local_steps(w, buf, grads, t, sgd)
        w = [x - cj for x, cj in zip(w, c, strict=True)]
        z, z_prev = z + sum(c) + mu * (z - z_prev), z
    return w, z


def easgd(
    w0: np.ndarray, grads: Grads, sgd: Sgd, alpha: float, tau: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """Synchronous EASGD: local steps; every τ steps, with ``d_i = x_i − x~`` from after the local step,

    ``x_i ← x_i − α d_i;  x~ ← x~ + α Σ_i d_i``. (EAMSGD is ``sgd`` with Nesterov momentum δ.)

    Returns every learner's weights and the centre x~.
    """
    w, buf = _replicas(w0, len(grads))
    centre = w[0].copy()
    for t in range(len(grads[0])):
        _local_steps(w, buf, grads, t, sgd)
        if (t + 1) % tau == 0:
            d = [x - centre for x in w]
            w = [x - alpha * dj for x, dj in zip(w, d, strict=True)]
            centre = centre + alpha * sum(d)
    return w, centre


class _Workers:
    """The server rules' workers: each one's ``(m, P)`` replicas, their momentum buffers and steps taken."""

    def __init__(self, w0: np.ndarray, grads: Mapping[int, Steps], sgd: Sgd, tau: int) -> None:
        self.grads, self.sgd, self.tau = grads, sgd, tau
        self.x = {r: np.tile(w0.astype(np.float64), (len(g[0]), 1)) for r, g in grads.items()}
        self.buf = {r: np.zeros_like(x) for r, x in self.x.items()}
        self.t = dict.fromkeys(grads, 0)

    def advance(self, r: int) -> bool:
        """Worker r's local steps up to its next message to the server (True) or its last step (False)."""
        while self.t[r] < len(self.grads[r]):
            self.x[r], self.buf[r] = self.sgd.step(self.x[r], self.buf[r], self.grads[r][self.t[r]])
            self.t[r] += 1
            if self.t[r] % self.tau == 0:
                return True
        return False


def easgd_async(
    w0: np.ndarray, grads: Mapping[int, Steps], sgd: Sgd, alpha: float, tau: int, order: Order
) -> tuple[dict[int, np.ndarray], np.ndarray, int]:
    """Asynchronous EASGD: a worker's request every τ local steps, served in ``order``; for each of its
    learners in turn ``e = α (x_j − x~);  x_j ← x_j − e;  x~ ← x~ + e``. A worker with no step left is done.

    Returns every worker's ``(m, P)`` weights, the centre and the number of elastic updates.
    """
    workers = _Workers(w0, grads, sgd, tau)
    x, centre = workers.x, w0.astype(np.float64)
    active, processed, updates = sorted(grads), 0, 0
    while active:
        r = order(processed, list(active))
        if workers.advance(r):
            for j in range(len(x[r])):
                e = alpha * (x[r][j] - centre)
                x[r][j] = x[r][j] - e
                centre = centre + e
                updates += 1
        else:
            active.remove(r)
        processed += 1
    return x, centre, updates


def localsgd(
    w0: np.ndarray,
    grads: Grads,
    sgd: Sgd,
    period: int,
    inner: int = 0,
    group: Callable[[int], int] = lambda g: 0,
) -> list[np.ndarray]:
    """LOCALSGD: local steps; after step t, ``w_g ← (1/k) Σ w`` when H | t + 1, else, when H_in | t + 1,
    ``w_g ← mean of w over the learners of g's node`` (``group(g)`` names the node of learner g).

    Returns every learner's weights.
    """
    k = len(grads)
    w, buf = _replicas(w0, k)
    for t in range(len(grads[0])):
        _local_steps(w, buf, grads, t, sgd)
        if (t + 1) % period == 0:
            w = [sum(w) / k] * k
        elif inner and (t + 1) % inner == 0:
            for node in {group(g) for g in range(k)}:
                members = [g for g in range(k) if group(g) == node]
                mean = sum(w[g] for g in members) / len(members)
                for g in members:
                    w[g] = mean
    return w


def bsp_avg(w0: np.ndarray, grads: Grads, sgd: Sgd) -> list[np.ndarray]:
    """BSP parameter mode: every learner's local step, then ``w_g ← (1/k) Σ_j w_j`` (LOCALSGD with H = 1)."""
    return localsgd(w0, grads, sgd, period=1)


def diloco(
    w0: np.ndarray, grads: Grads, sgd: Sgd, period: int, outer_lr: float, outer_momentum: float
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """DILOCO: H inner steps, then ``Δ = z − (1/k) Σ w;  v ← μ_out v + Δ;  z ← z − η_out (Δ + μ_out v)``
    and every learner restarts from z (its inner momentum kept).

    Returns every learner's weights, z and v.
    """
    k = len(grads)
    w, buf = _replicas(w0, k)
    z, v = w[0].copy(), np.zeros_like(w[0])
    for t in range(len(grads[0])):
        _local_steps(w, buf, grads, t, sgd)
        if (t + 1) % period == 0:
            delta = z - sum(w) / k
            v = outer_momentum * v + delta
            z = z - outer_lr * (delta + outer_momentum * v)
            w = [z.copy() for _ in range(k)]
    return w, z, v


def initial_mass(g: int, k: int) -> int:
    """GOSGD's initial weight a_g = 1/k in units of 2⁻⁵² (the first ``UNIT mod k`` learners one unit more)."""
    return UNIT // k + (g < UNIT % k)


def gosgd(
    w0: np.ndarray, grads: Grads, sgd: Sgd, schedule: Callable[[int, int], int | None]
) -> tuple[list[np.ndarray], list[int]]:
    """GOSGD with a fixed schedule: each step every learner's local step, then it merges the messages
    sent to it at the previous step, in source order,
    ``x_i ← (a_i x_i + a_s x_s) / (a_i + a_s);  a_i ← a_i + a_s``; then learner i sends to
    ``schedule(t, i)`` (None: no one) ``(x_i, a_i/2)`` and keeps ``a_i/2``. After the last step every
    learner merges what is left.

    Returns every learner's weights and its weight a_i in units of 2⁻⁵².
    """
    k = len(grads)
    x, buf = _replicas(w0, k)
    mass = [initial_mass(g, k) for g in range(k)]
    inbox: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(k)]

    def merge(g: int) -> None:
        for x_s, m_s in inbox[g]:
            x[g] = (mass[g] * x[g] + m_s * x_s) / (mass[g] + m_s)
            mass[g] += m_s
        inbox[g] = []

    for t in range(len(grads[0])):
        _local_steps(x, buf, grads, t, sgd)
        for g in range(k):
            merge(g)
        for g in range(k):
            dst = schedule(t, g)
            if dst is not None:
                half = mass[g] // 2
                mass[g] -= half
                inbox[dst].append((x[g].copy(), half))
    for g in range(k):
        merge(g)
    return x, mass


def parameter_server(
    w0: np.ndarray,
    grads: Mapping[int, Steps],
    sgd: Sgd,
    tau: int,
    scale: float,
    order: Order,
    policy: str = "ssp",
    bound: float = math.inf,
    n: int = 0,
) -> tuple[dict[int, np.ndarray], np.ndarray, int]:
    """Parameter-server SGD served in ``order``: every τ local steps worker r pushes
    ``Δ = Σ_i (x_i − x_pulled)`` over its learners; the server applies ``w ← w + scale · Δ`` (clock
    ``c_r ← c_r + 1``) and replies with w, which every learner of r adopts (``x_i ← w;  x_pulled ← w``)
    unless ``policy`` holds the reply:

    * ``ssp``: held while ``c_r − c_min > s`` (s = ``bound``; s = ∞ is ASGD), c_min over workers training;
    * ``psgd``: once a push puts r ``bound`` pushes ahead of c_min, held until every other training worker
      has pushed again;
    * ``weedout``: never held, but a push is merged only if at most ``max(n, workers)`` pushes reached the
      server since r last pulled (else discarded: r restarts from w).

    Returns every worker's ``(m, P)`` weights, w and the number of merged pushes.
    """
    workers = _Workers(w0, grads, sgd, tau)
    x, pulled, clock = workers.x, {r: w0.astype(np.float64) for r in grads}, dict.fromkeys(grads, 0)
    w, held, done, processed, updates = w0.astype(np.float64), set(), set(), 0, 0
    received, pulled_at, waits = 0, dict.fromkeys(grads, 0), {}
    while len(done) < len(grads):
        r = order(processed, sorted(q for q in grads if q not in done and q not in held))
        if workers.advance(r):
            received += 1
            if policy != "weedout" or received - pulled_at[r] <= max(n, len(grads)):
                w = w + scale * (x[r] - pulled[r]).sum(axis=0)
                updates += 1
            clock[r] += 1
            active = [clock[q] for q in grads if q not in done]
            if policy == "psgd" and clock[r] - min(active) >= bound:
                waits[r] = {q: clock[q] for q in grads if q != r}
            held.add(r)
        else:
            done.add(r)
        active = [clock[q] for q in grads if q not in done]
        c_min = min(active) if active else math.inf
        for q in sorted(held):
            if policy == "ssp":
                free = clock[q] <= c_min + bound
            elif policy == "psgd":
                free = q not in waits or all(p in done or clock[p] > c for p, c in waits[q].items())
            else:
                free = True
            if free:
                held.discard(q)
                waits.pop(q, None)
                x[q], pulled[q] = np.tile(w, (len(x[q]), 1)), w.copy()
                pulled_at[q] = received
        processed += 1
    return x, w, updates


def gsp(
    w0: np.ndarray,
    grads: Mapping[int, Steps],
    sgd: Sgd,
    groups: list[list[int]],
    tau: int,
    scale: float,
    order: Order,
) -> tuple[dict[int, np.ndarray], np.ndarray, list[float]]:
    """GSP (one learner per worker): a group steps on its members' mean gradient (identical replicas);
    every τ steps its leader's push, served in ``order`` among the leaders, is applied with the staleness
    weight ``w ← w + scale · Δ / Y_G``, ``Y_G = 1 + updates since G last pulled``, and G adopts w.

    Returns every worker's weights, w and the weights 1/Y of the pushes in the order applied.
    """
    k = len(groups)
    x, buf = _replicas(w0, k)
    pulled = [v.copy() for v in x]
    t, seen, done = [0] * k, [0] * k, set()
    w, updates, processed, weights = w0.astype(np.float64), 0, 0, []
    while len(done) < k:
        leader = order(processed, sorted(groups[i][0] for i in range(k) if i not in done))
        i = next(i for i in range(k) if groups[i][0] == leader)
        pushed = False
        while t[i] < len(grads[leader]):
            g = np.mean([grads[r][t[i]][0] for r in groups[i]], axis=0)
            x[i], buf[i] = sgd.step(x[i], buf[i], g)
            t[i] += 1
            if t[i] % tau == 0:
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
