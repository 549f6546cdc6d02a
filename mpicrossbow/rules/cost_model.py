"""The cost model of one training step per rule: compute plus the rule's communication, priced per link.

Links follow the alpha–beta model: a message of ``n`` bytes over a link costs ``α + n β`` (latency α in s,
β = 1 / bandwidth in s/byte). A cluster has ``g`` GPUs (ranks) per node, an intra-node link (shared memory,
NVLink, PCIe) and an inter-node link (the node's network card).

Collectives (p ranks, n bytes each):

* **ring allreduce**: ``2(p−1) α + 2 (p−1)/p · n β``. Within a node over the intra link; across nodes the ring
  crosses every node's card once each way, so each card carries the same ``2 (p−1)/p · n`` and the inter link
  prices it (NCCL's and Horovod's rings);
* **tree allreduce** (pipelined, as NCCL's at scale): ``2 log2(p) α + 2 n β``; the model takes the cheaper;
* **halving–doubling** (MPICH's allreduce for buffers past a few kB, Rabenseifner's reduce-scatter by
  recursive halving and allgather by recursive doubling) over the largest power of two ``q ≤ p``:
  ``2 log2(q) α + 2 (q−1)/q · n β``, plus, when p is not a power of two, the fold — the ``p − q`` extra
  ranks first send their whole buffer to a partner and receive the result back at the end, ``2 (α + n β)``
  (three ranks: ``3 (α + n β)``, recursive doubling's one exchange between the two being the cheaper, against
  the ring's ``4 α + 4/3 n β``). For short buffers MPICH takes recursive doubling, ``log2(q) (α + n β)`` plus
  the fold; the model takes the cheaper of the two. A cluster
  whose communicator is plain MPI across nodes (``collectives = "mpich"``) prices its allreduces so; the
  default, ``"nccl"``, the ring or tree;
* **point to point**: ``α + n β``.

Rules (``compute`` = one step's forward, backward and update on one rank; ``c`` = the allreduce of the
model's ``n`` bytes; ``γ`` = seconds per byte of one elementwise pass over the parameters, memory-bound; the
passes each rule makes are counted from its code, :data:`PASSES`):

* BSP: ``compute + max(0, c − overlap · compute)`` — ``overlap`` is the share of the step the gradient
  allreduce can hide behind backward (0: none, the conservative default);
* SMA: ``compute + max(0, c − compute) + 5 n γ`` — its allreduce overlaps the next step's compute where the
  communicator overlaps at all (NCCL, MPI; not this project's blocking shared-memory one: then ``+ c``);
* EASGD (sync): ``compute + (c + 3 n γ) / τ``; LOCALSGD: ``+ (c + n γ) / H``; DILOCO: ``+ (c + 4 n γ) / H``;
* GOSGD: ``compute + p_gossip · (α + n β + 3 n γ)`` — each step a learner sends a snapshot of its weights with
  probability p, and a receiver merges it;
* parameter servers (ASGD, SSP, PSGD, WEEDOUT): W = p − S workers
  push ``n/S`` bytes to each of S servers every τ steps and wait for the reply, ``2 (α + (n/S) β)`` plus the
  server's 2 passes before it replies, with 4 passes of their own (Δ, the push copy, adopting w twice); a
  server serves one push in ``s = 2 (n/S) β + 2 (n/S) γ`` within a node (the cores copy the push in and the
  reply out; apply Δ, copy w out), ``s = (n/S) β + 2 (n/S) γ`` across nodes (the link is full duplex: a
  reply leaves while the next push arrives). A push waits for the pushes of the other workers only (a worker
  waiting for its reply pushes nothing: the arrival theorem of closed queues), which keep the server busy a
  share ``ρ = (W − 1) s / (τ T)`` of each worker's step time T: while ``ρ < 1`` a push waits
  ``ρ s / (2 (1 − ρ))`` more (an M/D/1 queue), and the server bounds the step, ``T ≥ W s / τ``;
* GSP: the W workers average their gradients in their group every step (an allreduce over W ranks) and only
  each group's leader pushes (``groups`` pushers for the server); after a pull the leader broadcasts w to the
  group (``log2(W) α + n β``, pipelined). Its groups are split communicators, which carry no shared-memory
  path: a cluster's ``group`` link prices them (the intra link where none is given).

Ranks sharing cores (``cores`` in a cluster: the cores the ranks run on, when fewer than the ranks, as on a
CPU test machine — one node's, or, for nodes that are namespaces of one machine, the machine's; 0 on GPU
clusters, where each rank has a core of its own): ``compute`` is then one rank's step with the others running
beside it (measured so), nothing overlaps (no core is free to drive a message while another rank computes),
and every rank's elementwise work takes ``p / cores`` times as long in wall time. So does communication
within a node, where moving bytes is the cores' own copying; across nodes the wire sets a message's time
and waiting for it takes no core's time from the others, so network time is not stretched. A parameter
server's step is at least the CPU seconds of one round — every worker's compute (``compute · cores / p``)
and the CPU part of its exchange, and of the server's service of each push — divided by ``cores``.

Efficiency at p ranks = samples/s ÷ (training ranks × one rank's samples/s alone). Known to be wrong where
the model is silent: stragglers and uneven ranks (it prices the average rank), network congestion from other
jobs, topology beyond two levels (a fat tree's oversubscription), and compute that changes with the rank
count (input pipelines, batch-norm statistics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Elementwise passes over the parameters per exchange, counted from each rule's code: SMA's correction,
#: subtraction and z update; EASGD's difference, pull and centre move; LOCALSGD's copy of the mean; DILOCO's
#: outer Nesterov step; GOSGD's snapshot and merge; a server worker's Δ, push copy and adoption; a server's
#: apply and reply copy per push.
PASSES = {"SMA": 5, "EASGD": 3, "LOCALSGD": 1, "DILOCO": 4, "GOSGD": 3, "worker": 4, "server": 2}


@dataclass(frozen=True)
class Link:
    """A link's latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte)."""

    alpha: float
    beta: float

    def message(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` over the link."""
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Cluster:
    """GPUs (ranks) per node, the two links, ``gamma`` (s/byte of one elementwise pass over the parameters)
    and whether the communicator overlaps an allreduce with compute."""

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    gamma: float = 0.0
    overlaps: bool = True
    #: The link of split communicators (GSP's groups), when it differs from the cluster's.
    group: Link | None = None
    #: Per model: seconds of one step's compute on one GPU (given by the cluster file).
    compute: dict[str, float] = field(default_factory=dict)
    #: Cores the ranks share (0: every rank has its own, as on a GPU cluster).
    cores: int = 0
    #: Whose allreduce algorithms the communicator runs: ``nccl`` (ring or tree, the cheaper) or ``mpich``
    #: (halving–doubling with a fold for a rank count that is not a power of two; plain MPI across nodes).
    collectives: str = "nccl"

    def share(self, p: int) -> float:
        """How many ranks share one core at p ranks (1 when each has its own)."""
        return p / self.cores if self.cores and p > self.cores else 1.0

    def within_node(self, p: int) -> bool:
        """Whether p ranks fit on one node (their messages are the cores' copies, not the network's)."""
        return p <= self.gpus_per_node

    def stretch(self, p: int) -> float:
        """How many times longer in wall time the communication of p ranks takes for ranks sharing cores:
        :meth:`share` within a node (the cores copy the bytes), 1 across nodes (the wire sets the time)."""
        return self.share(p) if self.within_node(p) else 1.0

    def link(self, p: int) -> Link:
        """The link that prices a collective over p ranks: intra-node up to one node, else the network."""
        return self.intra if p <= self.gpus_per_node else self.inter


def ring_allreduce(nbytes: float, p: int, link: Link) -> float:
    """``2(p−1) α + 2 (p−1)/p · n β`` (0 for one rank)."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def tree_allreduce(nbytes: float, p: int, link: Link) -> float:
    """Pipelined tree: ``2 log2(p) α + 2 n β`` (0 for one rank)."""
    if p <= 1:
        return 0.0
    return 2 * math.log2(p) * link.alpha + 2 * nbytes * link.beta


def halving_doubling_allreduce(nbytes: float, p: int, link: Link) -> float:
    """MPICH's allreduce: the cheaper of halving–doubling (``2 log2(q) α + 2 (q−1)/q · n β``) and recursive
    doubling (``log2(q) (α + n β)``) over the largest power of two ``q ≤ p``, plus ``2 (α + n β)`` for the
    fold when ``p ≠ q`` (0 for one rank)."""
    if p <= 1:
        return 0.0
    q = 1 << (p.bit_length() - 1)
    steps = math.log2(q)
    inner = min(2 * steps * link.alpha + 2 * (q - 1) / q * nbytes * link.beta, steps * link.message(nbytes))
    return inner + (2 * link.message(nbytes) if p != q else 0.0)


def allreduce_on(nbytes: float, p: int, link: Link, collectives: str = "nccl") -> float:
    """An allreduce of p ranks over ``link`` by ``collectives``' algorithms (:class:`Cluster`)."""
    if collectives == "mpich":
        return halving_doubling_allreduce(nbytes, p, link)
    if collectives != "nccl":
        raise ValueError(f"no allreduce model for collectives = {collectives!r} (nccl, mpich)")
    return min(ring_allreduce(nbytes, p, link), tree_allreduce(nbytes, p, link))


def cluster_allreduce(nbytes: float, p: int, cluster: Cluster) -> float:
    """The allreduce of p ranks over the link that they need, by the cluster's algorithms."""
    return allreduce_on(nbytes, p, cluster.link(p), cluster.collectives)


@dataclass(frozen=True)
class Step:
    """One rank's step time, the part that is communication, and how many ranks train."""

    seconds: float
    comm: float
    training_ranks: int


def server_step(
    compute: float,
    nbytes: float,
    p: int,
    cluster: Cluster,
    servers: int,
    tau: int,
    pushers: int | None = None,
) -> Step:
    """A parameter-server rule's worker step (see the module doc): round trip, queueing, server bound;
    ``pushers`` (default: every worker) are the ranks that push."""
    workers = p - servers if pushers is None else pushers
    shard = nbytes / servers
    link = cluster.link(p)
    share, stretch = cluster.share(p), cluster.stretch(p)
    applying = PASSES["server"] * shard * cluster.gamma  # before the reply leaves: on the worker's path
    own = PASSES["worker"] * nbytes * cluster.gamma
    wire = 2 * link.message(shard)
    on_cores = cluster.within_node(p)  # within a node the cores move the bytes; across nodes the wire does
    service = (2 if on_cores else 1) * shard * link.beta + applying  # a full-duplex link: in and out at once
    step = compute + (wire * stretch + (applying + own) * share) / tau
    bound = workers * service / tau
    rho = (workers - 1) * service / (tau * step)  # the other workers' pushes
    if rho >= 1:
        return Step(bound, bound - compute, p - servers)
    wait = rho * service / (2 * (1 - rho))
    seconds = max(step + wait / tau, bound)
    if share > 1:  # the cores' seconds of one round: every worker's step and the server's pushes
        exchange = ((wire if on_cores else 0.0) + applying + own) / tau
        serving = (2 * shard * link.beta if on_cores else 0.0) + applying
        training = p - servers
        busy = (training * (compute / share + exchange) + workers * serving / tau) / cluster.cores
        seconds = max(seconds, busy)
    return Step(seconds, seconds - compute, p - servers)


def step_time(
    rule: str,
    p: int,
    compute: float,
    nbytes: float,
    cluster: Cluster,
    *,
    overlap: float = 0.0,
    period: int = 10,
    gossip: float = 0.1,
    servers: int = 1,
    groups: int = 1,
) -> Step:
    """One step of ``rule`` on p ranks (``period``: τ of EASGD and the servers, H of LOCALSGD/DILOCO)."""
    rule = rule.upper()
    if p == 1 and rule not in ("ASGD", "SSP", "PSGD", "WEEDOUT", "GSP"):
        return Step(compute, 0.0, 1)
    c = cluster_allreduce(nbytes, p, cluster)
    share, stretch = cluster.share(p), cluster.stretch(p)
    passes = PASSES.get(rule, 0) * nbytes * cluster.gamma * share
    overlaps = cluster.overlaps and share == 1  # no free core, nothing overlaps
    if rule == "BSP":
        comm = max(0.0, c - (overlap if overlaps else 0.0) * compute) * stretch
    elif rule == "SMA":
        comm = (max(0.0, c - compute) if overlaps else c) * stretch + passes
    elif rule in ("EASGD", "LOCALSGD", "DILOCO"):
        comm = (c * stretch + passes) / period
    elif rule == "GOSGD":
        comm = gossip * (cluster.link(p).message(nbytes) * stretch + passes)
    elif rule in ("ASGD", "SSP", "PSGD", "WEEDOUT"):
        return server_step(compute, nbytes, p, cluster, servers, period)
    elif rule == "GSP":
        workers, link = p - servers, cluster.group or cluster.link(p)
        pushed = server_step(compute, nbytes, p, cluster, servers, period, pushers=groups)
        if workers < 2:
            return pushed
        average = allreduce_on(nbytes, workers, link, cluster.collectives)
        extra = (average + (math.log2(workers) * link.alpha + nbytes * link.beta) / period) * stretch
        return Step(pushed.seconds + extra, pushed.comm + extra, pushed.training_ranks)
    else:
        raise ValueError(f"no cost model for RULE={rule}")
    return Step(compute + comm, comm, p)


def scaling_efficiency(
    rule: str, p: int, compute: float, nbytes: float, cluster: Cluster, **hyper: float
) -> float:
    """Samples/s at p ranks over (training ranks × one rank alone): 1.0 is perfect scaling."""
    step = step_time(rule, p, compute, nbytes, cluster, **hyper)  # type: ignore[arg-type]
    return compute / step.seconds * step.training_ranks / p
