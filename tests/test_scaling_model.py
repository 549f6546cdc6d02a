"""The scaling cost model's formulas against cases computed by hand (benchmarks/scaling_model.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from benchmarks.scaling import load_cluster
from benchmarks.scaling_model import (
    Cluster,
    Link,
    allreduce,
    efficiency,
    ring_allreduce,
    step_time,
    tree_allreduce,
)
from conftest import REPO

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
    assert allreduce(1e3, 1024, Cluster("x", 1024, LINK, LINK)) == pytest.approx(20e-6 + 2e-6)


def test_the_network_prices_collectives_beyond_one_node() -> None:
    assert allreduce(MB, 4, NODE) == pytest.approx(6e-6 + 1.5e-3)  # one node: the intra link
    # 8 ranks on two nodes: ring over the network, 2·7·10 µs + 2·(7/8)·1e6·1e-8 = 140 µs + 17.5 ms
    assert allreduce(MB, 8, NODE) == pytest.approx(140e-6 + 17.5e-3)


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
    # 4 ranks, 1 server, 3 workers, τ = 1: round trip 2·(1 µs + 1 ms); service 2 ms per push
    light = step_time("ASGD", 4, 0.1, MB, NODE, period=1)
    rho = 3 * 2e-3 / (0.1 + 2 * 1.001e-3)
    wait = rho * 2e-3 / (2 * (1 - rho))
    assert light.seconds == pytest.approx(0.1 + 2 * 1.001e-3 + wait) and light.training_ranks == 3
    heavy = step_time("ASGD", 4, 0.001, MB, NODE, period=1)  # 3 pushes of 2 ms per 1 ms step: ρ > 1
    assert heavy.seconds == pytest.approx(3 * 2e-3)
    # efficiency counts the server's GPU: at best 3 of 4
    assert efficiency("ASGD", 4, 10.0, 1.0, NODE, period=1) == pytest.approx(0.75, rel=1e-3)


def test_ranks_sharing_cores_stretch_exchange_and_lose_overlap() -> None:
    """4 ranks on 2 cores: the allreduce cannot hide behind compute and takes twice as long in wall time;
    a server round is at least the cores' seconds of every worker's step and every push's service."""
    shared = dataclasses.replace(NODE, cores=2)
    c = ring_allreduce(MB, 4, LINK)
    assert step_time("SMA", 4, 0.01, MB, shared).seconds == pytest.approx(0.01 + 2 * c)
    assert step_time("BSP", 4, 0.01, MB, shared, overlap=0.5).seconds == pytest.approx(0.01 + 2 * c)
    assert step_time("BSP", 2, 0.01, MB, shared).seconds == step_time("BSP", 2, 0.01, MB, NODE).seconds
    # A worker's round trip, 2·(1 µs + 1 ms), takes twice as long; the queue as before (3 pushes of 2 ms)
    serial = 0.01 + 2 * 2 * 1.001e-3
    rho = 3 * 2e-3 / serial
    asgd = step_time("ASGD", 4, 0.01, MB, shared, period=1).seconds
    assert asgd == pytest.approx(serial + rho * 2e-3 / (2 * (1 - rho)))
    # never below the cores' seconds of one round: 3 workers' compute (0.01 · 2/4) and round trips, 3 pushes
    assert asgd >= (3 * (0.005 + 2 * 1.001e-3) + 3 * 2e-3) / 2


def test_the_horovod_paper_cluster_scales_inception_and_resnet101_near_90_percent() -> None:
    """The paper's ~90 % at 512 GPUs (ring-allreduce BSP), within 10 points, from its hardware alone."""
    cluster, params, _ = load_cluster(REPO / "benchmarks" / "clusters" / "horovod_pascal.ini")
    for model in ("inception3", "resnet101"):
        got = efficiency("BSP", 512, cluster.compute[model], 4 * params[model], cluster)
        assert abs(got - 0.90) <= 0.10, (model, got)
    assert not math.isnan(efficiency("GOSGD", 1024, 0.5, 4 * params["vgg16"], cluster))


def test_cluster_files_load(tmp_path: Path) -> None:
    cluster, _, batch = load_cluster(REPO / "benchmarks" / "clusters" / "h100_ib.ini")
    assert cluster.gpus_per_node == 8 and cluster.inter.beta == pytest.approx(8 / 3200e9) and batch == 64
