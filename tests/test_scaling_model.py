"""The scaling cost model's formulas against cases computed by hand (mpicrossbow/rules/cost_model.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from benchmarks.scaling import load_cluster
from conftest import REPO
from mpicrossbow.rules.cost_model import (
    Cluster,
    Link,
    allreduce_on,
    cluster_allreduce,
    halving_doubling_allreduce,
    ring_allreduce,
    scaling_efficiency,
    step_time,
    tree_allreduce,
)

#: 1 µs latency, 1 GB/s: 1 ns a byte.
LINK = Link(1e-6, 1e-9)
NODE = Cluster("test", gpus_per_node=4, intra=LINK, inter=Link(10e-6, 1e-8))
MB = 1e6


def test_ring_and_tree_allreduce_by_hand() -> None:
    # ring, 4 ranks, 1 MB: 2·3·1 µs + 2·(3/4)·1e6·1e-9 s = 6 µs + 1.5 ms
    assert ring_allreduce(MB, 4, LINK) == pytest.approx(6e-6 + 1.5e-3)
    # tree, 4 ranks, 1 MB: 2·log2(4)·1 µs + 2·1e6·1e-9 = 4 µs + 2 ms
    assert tree_allreduce(MB, 4, LINK) == pytest.approx(4e-6 + 2e-3)
    assert ring_allreduce(MB, 1, LINK) == tree_allreduce(MB, 1, LINK) == 0.0
    # 1,024 ranks, 1 kB: the tree's 20 latencies beat the ring's 2,046
    assert cluster_allreduce(1e3, 1024, Cluster("x", 1024, LINK, LINK)) == pytest.approx(20e-6 + 2e-6)


def test_the_network_prices_collectives_beyond_one_node() -> None:
    assert cluster_allreduce(MB, 4, NODE) == pytest.approx(6e-6 + 1.5e-3)  # one node: the intra link
    # 8 ranks on two nodes: ring over the network, 2·7·10 µs + 2·(7/8)·1e6·1e-8 = 140 µs + 17.5 ms
    assert cluster_allreduce(MB, 8, NODE) == pytest.approx(140e-6 + 17.5e-3)


def test_rule_steps_by_hand() -> None:
    c = ring_allreduce(MB, 4, LINK)  # 1.506 ms
    assert step_time("BSP", 4, 0.01, MB, NODE).seconds == pytest.approx(0.01 + c)
    assert step_time("BSP", 4, 0.01, MB, NODE, overlap=0.5).seconds == pytest.approx(0.01)  # hidden
    assert step_time("SMA", 4, 0.001, MB, NODE).seconds == pytest.approx(0.001 + c - 0.001)
    assert step_time("LOCALSGD", 4, 0.01, MB, NODE, period=8).seconds == pytest.approx(0.01 + c / 8)
    assert step_time("GOSGD", 4, 0.01, MB, NODE, gossip=0.1).seconds == pytest.approx(
        0.01 + 0.1 * (1e-6 + 1e-3)
    )
    assert step_time("BSP", 1, 0.01, MB, NODE).seconds == 0.01


def test_a_parameter_server_queues_and_then_bounds_the_step() -> None:
    # 4 ranks, 1 server, 3 workers, τ = 1: round trip 2·(1 µs + 1 ms); service 2 ms per push; a push waits
    # for the 2 other workers' pushes
    light = step_time("ASGD", 4, 0.1, MB, NODE, period=1)
    rho = 2 * 2e-3 / (0.1 + 2 * 1.001e-3)
    wait = rho * 2e-3 / (2 * (1 - rho))
    assert light.seconds == pytest.approx(0.1 + 2 * 1.001e-3 + wait) and light.training_ranks == 3
    heavy = step_time("ASGD", 4, 0.001, MB, NODE, period=1)  # 2 other pushes of 2 ms per 3 ms step: ρ > 1
    assert heavy.seconds == pytest.approx(3 * 2e-3)
    # efficiency counts the server's GPU: at best 3 of 4
    assert scaling_efficiency("ASGD", 4, 10.0, 1.0, NODE, period=1) == pytest.approx(0.75, rel=1e-3)


def test_ranks_sharing_cores_stretch_exchange_and_lose_overlap() -> None:
    """4 ranks on 2 cores: the allreduce cannot hide behind compute and takes twice as long in wall time;
    a server round is at least the cores' seconds of every worker's step and every push's service."""
    shared = dataclasses.replace(NODE, cores=2)
    c = ring_allreduce(MB, 4, LINK)
    assert step_time("SMA", 4, 0.01, MB, shared).seconds == pytest.approx(0.01 + 2 * c)
    assert step_time("BSP", 4, 0.01, MB, shared, overlap=0.5).seconds == pytest.approx(0.01 + 2 * c)
    assert step_time("BSP", 2, 0.01, MB, shared).seconds == step_time("BSP", 2, 0.01, MB, NODE).seconds
    # A worker's round trip, 2·(1 µs + 1 ms), takes twice as long; the queue as before (2 others' pushes)
    serial = 0.01 + 2 * 2 * 1.001e-3
    rho = 2 * 2e-3 / serial
    asgd = step_time("ASGD", 4, 0.01, MB, shared, period=1).seconds
    assert asgd == pytest.approx(serial + rho * 2e-3 / (2 * (1 - rho)))
    # never below the cores' seconds of one round: 3 workers' compute (0.01 · 2/4) and round trips, 3 pushes
    assert asgd >= (3 * (0.005 + 2 * 1.001e-3) + 3 * 2e-3) / 2


def test_the_horovod_paper_cluster_scales_inception_and_resnet101_near_90_percent() -> None:
    """The paper's ~90 % at 512 GPUs (ring-allreduce BSP), within 10 points, from its hardware alone."""
    cluster, params, _ = load_cluster(REPO / "benchmarks" / "clusters" / "horovod_pascal.ini")
    for model in ("inception3", "resnet101"):
        got = scaling_efficiency("BSP", 512, cluster.compute[model], 4 * params[model], cluster)
        assert abs(got - 0.90) <= 0.10, (model, got)
    assert not math.isnan(scaling_efficiency("GOSGD", 1024, 0.5, 4 * params["vgg16"], cluster))


def test_cluster_files_load(tmp_path: Path) -> None:
    cluster, _, batch = load_cluster(REPO / "benchmarks" / "clusters" / "h100_ib.ini")
    assert cluster.gpus_per_node == 8 and cluster.inter.beta == pytest.approx(8 / 3200e9) and batch == 64


def test_mpich_allreduce_halves_and_doubles_and_folds_odd_rank_counts() -> None:
    # 2 ranks: recursive doubling's one exchange, α + n β, beats halving-doubling's 2 α + n β
    assert halving_doubling_allreduce(MB, 2, LINK) == pytest.approx(1e-6 + 1e-3)
    # 3 ranks: that exchange between two, plus the third's buffer in and the result out: 3 (α + n β)
    assert halving_doubling_allreduce(MB, 3, LINK) == pytest.approx(3 * (1e-6 + 1e-3))
    # 4 ranks, 1 MB: halving-doubling, 2·2·1 µs + 2·(3/4)·1 ms, beats recursive doubling's 2 (α + n β)
    assert halving_doubling_allreduce(MB, 4, LINK) == pytest.approx(4e-6 + 1.5e-3)
    # 6 ranks: 4 of them as above, plus the fold
    assert halving_doubling_allreduce(MB, 6, LINK) == pytest.approx(4e-6 + 1.5e-3 + 2 * (1e-6 + 1e-3))
    assert halving_doubling_allreduce(MB, 1, LINK) == 0.0
    assert allreduce_on(MB, 3, LINK) == pytest.approx(ring_allreduce(MB, 3, LINK))  # nccl: the ring here
    mpich = dataclasses.replace(NODE, collectives="mpich")
    assert cluster_allreduce(MB, 8, mpich) == pytest.approx(halving_doubling_allreduce(MB, 8, NODE.inter))
    with pytest.raises(ValueError, match="collectives"):
        allreduce_on(MB, 3, LINK, "gloo")


#: Three one-rank nodes on two cores (namespace nodes of one machine): 10 µs, 10 ns a byte between nodes.
NODES = Cluster("nodes", gpus_per_node=1, intra=LINK, inter=Link(10e-6, 1e-8), cores=2, collectives="mpich")


def test_network_time_is_not_stretched_by_shared_cores() -> None:
    """3 ranks on 2 cores: across nodes a message takes the wire's time; within a node the cores' copies
    take 3/2 as long."""
    wire = halving_doubling_allreduce(MB, 3, NODES.inter)  # 3·(10 µs + 10 ms)
    assert step_time("BSP", 3, 0.01, MB, NODES).seconds == pytest.approx(0.01 + wire)
    one_node = dataclasses.replace(NODES, gpus_per_node=4)
    assert step_time("BSP", 3, 0.01, MB, one_node).seconds == pytest.approx(
        0.01 + 1.5 * halving_doubling_allreduce(MB, 3, LINK)
    )
    assert step_time("LOCALSGD", 3, 0.01, MB, NODES, period=8).seconds == pytest.approx(0.01 + wire / 8)


def test_a_lone_worker_never_queues_and_a_full_duplex_server_serves_the_push_alone() -> None:
    # 2 nodes, one server, one worker: its round trip 2·(10 µs + 10 ms), no other push to wait for
    assert step_time("ASGD", 2, 0.01, MB, NODES, period=1).seconds == pytest.approx(0.01 + 2 * 10.01e-3)
    # 3 nodes, 2 workers: a push holds the server's link 10 ms (the reply leaves on the other direction);
    # the other worker keeps it busy ρ = 10 ms / 30.02 ms of a step
    step = 0.01 + 2 * 10.01e-3
    rho = 1e-2 / step
    asgd = step_time("ASGD", 3, 0.01, MB, NODES, period=1).seconds
    assert asgd == pytest.approx(step + rho * 1e-2 / (2 * (1 - rho)))
    # GSP, one group: its leader alone pushes (no queue); the 2 workers average (2 ranks: 10.01 ms) and the
    # leader broadcasts w (10 µs + 10 ms)
    gsp = step_time("GSP", 3, 0.01, MB, NODES, period=1).seconds
    assert gsp == pytest.approx(step + 10.01e-3 + 10.01e-3)
