"""Core binding: one CPU set per rank of a node, applied before CUDA starts, and a table of what was done.

Modes (``[numa] bind`` or ``crossbow-launch -bind MODE``):

* ``none`` — leave the affinity as the process got it;
* ``core`` — the node's cores split into contiguous, disjoint blocks, one per local rank;
* ``numa`` / ``socket`` — local ranks spread over NUMA nodes / packages in blocks; the ranks of one domain
  split its cores (with fewer ranks than domains a rank gets several whole domains);
* ``gpu`` — the cores local to the rank's GPU, split evenly among the local ranks whose GPUs share them
  (CPU-only ranks, or a topology without GPUs, fall back to ``numa`` with a warning).

Binding applies to every thread of the process and sets torch's and OpenMP's thread counts to the cores
given, or to ``OMP_NUM_THREADS`` where the process was started with it (the user's word wins, as under
torchrun: several jobs sharing a node's cores must not each start a thread per core). When
``mpirun`` or ``srun`` has already bound the ranks (their CPU sets differ on one node, or a lone rank holds
less than its cgroup allows), that binding is kept and reported, not fought. Rank 0 prints a
``--report-bindings`` style table gathered over MPI.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .devices import DeviceSpec
from .topology import CpuSet, Topology, format_cpulist, load_topology, numa_nodes_from_sysfs, parse_cpulist
from .world import World

log = logging.getLogger(__name__)

Mode = Literal["none", "core", "numa", "socket", "gpu"]
MODES: tuple[str, ...] = ("none", "core", "numa", "socket", "gpu")


@dataclass(frozen=True)
class RankFacts:
    """What one rank knows about itself before binding; gathered so every rank can plan its node."""

    rank: int
    host: str
    local_rank: int
    device: str
    affinity: tuple[int, ...]
    allowed: tuple[int, ...]


@dataclass(frozen=True)
class Binding:
    """The CPUs one rank runs on, and who decided it (``core``/``numa``/... , ``launcher`` or ``none``)."""

    rank: int
    host: str
    device: str
    cpus: tuple[int, ...]
    numa_nodes: tuple[int, ...]
    source: str
    threads: int


# --------------------------------------------------------------------------------- planning
def split_evenly(cores: Sequence[CpuSet], ranks: int) -> list[CpuSet]:
    """Contiguous blocks of ``cores`` for ``ranks`` ranks (sizes differ by at most one core).

    With more ranks than cores, rank i shares core ``i % len(cores)`` (not disjoint; the caller warns).
    """
    if ranks < 1:
        return []
    if not cores:
        raise ValueError("no cores to bind to")
    if ranks > len(cores):
        return [cores[i % len(cores)] for i in range(ranks)]
    out = []
    for i in range(ranks):
        lo, hi = i * len(cores) // ranks, (i + 1) * len(cores) // ranks
        out.append(frozenset().union(*cores[lo:hi]))
    return out


def _by_domains(topo: Topology, domains: Sequence[CpuSet], ranks: int) -> list[CpuSet]:
    """Spread ``ranks`` over ``domains`` in blocks; ranks of one domain split its cores."""
    domains = [d for d in domains if d]
    if len(domains) >= ranks:  # each rank takes whole domains
        return [
            frozenset().union(*domains[i * len(domains) // ranks : (i + 1) * len(domains) // ranks])
            for i in range(ranks)
        ]
    owner = [i * len(domains) // ranks for i in range(ranks)]
    out: list[CpuSet] = []
    for d, domain in enumerate(domains):
        members = owner.count(d)
        out += split_evenly([c for c in topo.cores if c <= domain] or [domain], members)
    return out


def plan(mode: str, topo: Topology, devices: Sequence[str]) -> list[CpuSet]:
    """The CPU set of each local rank (in local-rank order) for ``mode``; ``devices``: their DEVICES entries.

    ``topo`` should already be restricted to the CPUs the ranks may use. ``none`` returns every usable CPU.
    """
    ranks = len(devices)
    if mode == "none":
        return [topo.cpus] * ranks
    if mode == "core":
        return split_evenly(topo.cores, ranks)
    if mode == "numa":
        return _by_domains(topo, [topo.numa_nodes[n] for n in sorted(topo.numa_nodes)], ranks)
    if mode == "socket":
        return _by_domains(topo, list(topo.packages), ranks)
    if mode == "gpu":
        indices = [_cuda_index(d) for d in devices]
        if not topo.gpus or any(i is None or i not in topo.gpus for i in indices):
            return plan("numa", topo, devices)
        groups: dict[CpuSet, list[int]] = {}
        for local, index in enumerate(indices):
            groups.setdefault(topo.gpus[index], []).append(local)  # type: ignore[index]
        out: list[CpuSet] = [frozenset()] * ranks
        for local_cpus, members in groups.items():
            cores = [c & local_cpus for c in topo.cores if c & local_cpus]
            for local, cpus in zip(members, split_evenly(cores or [local_cpus], len(members)), strict=True):
                out[local] = cpus
        return out
    raise ValueError(f"unknown binding mode {mode!r}; choose one of {', '.join(MODES)}")


def _cuda_index(device: str) -> int | None:
    name = device.rpartition(":")[2]
    if name.startswith("cuda"):
        return int(name[4:] or 0)
    return None


def gpu_fallback_reason(topo: Topology, devices: Sequence[str]) -> str | None:
    """Why ``gpu`` mode binds like ``numa`` on this node, or None when every rank's GPU has a locality."""
    indices = [_cuda_index(d) for d in devices]
    if any(i is None for i in indices):
        return "some ranks of this node drive no GPU"
    if not topo.gpus:
        return "no GPU locality found (hwloc, sysfs, nvidia-smi)"
    missing = [i for i in indices if i not in topo.gpus]
    if missing:
        return f"no locality known for cuda{missing[0]}"
    return None


def prebound(facts: Sequence[RankFacts]) -> bool:
    """True when the launcher bound this node's ranks: their CPU sets differ, or a lone one is narrowed."""
    sets = {f.affinity for f in facts}
    if len(sets) > 1:
        return True
    return len(facts) == 1 and set(facts[0].affinity) < set(facts[0].allowed)


# --------------------------------------------------------------------------------- applying
def allowed_cpus() -> CpuSet:
    """The CPUs this process's cgroup allows (cgroup v2 or v1 cpuset), else every online CPU."""
    candidates: list[Path] = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if hierarchy == "0":
                candidates.append(Path("/sys/fs/cgroup") / rel / "cpuset.cpus.effective")
            elif "cpuset" in controllers.split(","):
                candidates.append(Path("/sys/fs/cgroup/cpuset") / rel / "cpuset.effective_cpus")
    except (OSError, ValueError):
        pass
    candidates.append(Path("/sys/devices/system/cpu/online"))
    for path in candidates:
        try:
            cpus = parse_cpulist(path.read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return frozenset(os.sched_getaffinity(0))


def set_affinity_all_threads(cpus: CpuSet) -> None:
    """Bind every thread of this process (MPI's and torch's included) to ``cpus``; new threads inherit it."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    os.sched_setaffinity(0, cpus)
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            continue


#: set_mempolicy(2) syscall numbers by machine; MPOL_PREFERRED keeps allocations local but never fails.
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261}
MPOL_PREFERRED = 1


def prefer_memory_node(node: int) -> bool:
    """Ask the kernel to allocate this process's memory on NUMA node ``node`` (preferred, not strict)."""
    import ctypes  # here, not at the top: crossbow-launch imports this module on its way to mpiexec
    import platform

    number = SET_MEMPOLICY.get(platform.machine())
    if number is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << node)
    return libc.syscall(number, MPOL_PREFERRED, ctypes.byref(mask), ctypes.c_ulong(node + 2)) == 0


#: ``OMP_NUM_THREADS`` as this process was started with it (read once: :func:`set_threads` writes the
#: variable later, and that is no request from the user).
STARTED_WITH_OMP = os.environ.get("OMP_NUM_THREADS", "")


def requested_threads(value: str | None = None) -> int | None:
    """The thread count ``OMP_NUM_THREADS`` asks for (``value``, else the process's starting one): its first
    entry (OpenMP allows a list, one per nesting level), or None when unset, empty or not a positive
    integer (the latter with a warning: the default applies)."""
    text = (STARTED_WITH_OMP if value is None else value).split(",", 1)[0].strip()
    if not text:
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    log.warning("OMP_NUM_THREADS=%r is not a positive integer; using the default thread count", text)
    return None


def set_threads(count: int) -> None:
    """torch's intra-op threads and OpenMP/MKL's (for libraries initialised later) to ``count``."""
    import torch

    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[key] = str(count)
    torch.set_num_threads(count)


def local_facts(world: World, device: str) -> RankFacts:
    """This rank's facts: where it runs, its device and its current and allowed CPU sets."""
    return RankFacts(
        rank=world.rank,
        host=world.hostname,
        local_rank=world.local_rank,
        device=device,
        affinity=tuple(sorted(os.sched_getaffinity(0))),
        allowed=tuple(sorted(allowed_cpus())),
    )


def gather_facts(world: World, device: str) -> list[RankFacts]:
    """Every rank's :class:`RankFacts` (collective over the world)."""
    mine = local_facts(world, device)
    return world.allgather(mine)


def bind(
    mode: str,
    facts: Sequence[RankFacts],
    rank: int,
    memory: bool = True,
    topo: Topology | None = None,
) -> Binding:
    """Plan this node and bind this rank (no communication). Returns what this rank now runs on.

    The machine's topology (hwloc, else sysfs) is read only when there is a plan to make: with ``none``, or
    when the launcher already bound the ranks, the report's NUMA column comes from sysfs alone.
    """
    me = facts[rank]
    # Ranks on this host by hostname, not by MPI's node: emulated nodes (two slurmd on one machine) share
    # the cores, and MPI may call them different nodes.
    node = sorted((f for f in facts if f.host == me.host), key=lambda f: (f.local_rank, f.rank))
    index = node.index(me)
    launcher_bound = prebound(node)
    if topo is None and mode != "none" and not launcher_bound:
        topo = load_topology()  # planning needs the machine's cores, packages and GPUs (hwloc)
    cpus: CpuSet = frozenset(me.affinity)
    source = "none"
    if launcher_bound:
        source = "launcher"
        if mode != "none" and index == 0:
            log.warning(
                "%s: the MPI launcher or Slurm already bound the ranks; keeping that binding (bind = %s "
                "not applied)",
                me.host,
                mode,
            )
    elif mode != "none":
        assert topo is not None
        usable = topo.restrict(frozenset(me.allowed) & frozenset(me.affinity))
        devices = [f.device for f in node]
        if mode == "gpu" and index == 0:
            reason = gpu_fallback_reason(usable, devices)
            if reason:
                log.warning("%s: bind = gpu binds like numa: %s", me.host, reason)
        sets = plan(mode, usable, devices)
        if index == 0 and len(set(sets)) < len(sets):
            log.warning(
                "%s: %d ranks but only %d cores to bind to: some ranks share cores",
                me.host,
                len(node),
                len(usable.cores),
            )
        cpus = sets[index]
        set_affinity_all_threads(cpus)
        source = mode
    numa_nodes = topo.numa_of(cpus) if topo is not None else _numa_of(cpus)
    if memory and source != "none" and len(numa_nodes) == 1:
        prefer_memory_node(numa_nodes[0])
    threads = requested_threads() or (
        len(cpus) if source != "none" else max(1, len(cpus) // max(1, len(node)))
    )
    set_threads(threads)
    return Binding(
        rank=rank,
        host=me.host,
        device=me.device,
        cpus=tuple(sorted(cpus)),
        numa_nodes=numa_nodes,
        source=source,
        threads=threads,
    )


def _numa_of(cpus: CpuSet) -> tuple[int, ...]:
    """The NUMA nodes of ``cpus`` when nothing was planned: from sysfs, hwloc only where sysfs fails."""
    try:
        nodes = numa_nodes_from_sysfs()
    except (OSError, ValueError):
        return load_topology().numa_of(cpus)
    return tuple(sorted(n for n, pus in nodes.items() if pus & cpus))


def report_table(bindings: Sequence[Binding]) -> str:
    """A ``--report-bindings`` style table: rank, host, device, cores, NUMA node, threads, who bound it."""
    header = ("rank", "host", "device", "cores", "NUMA node", "threads", "bound by")
    rows = [
        (
            str(b.rank),
            b.host,
            b.device,
            format_cpulist(set(b.cpus)),
            ",".join(map(str, b.numa_nodes)) or "-",
            str(b.threads),
            b.source,
        )
        for b in sorted(bindings, key=lambda b: b.rank)
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    )


def report(world: World, binding: Binding) -> list[Binding]:
    """Gather every rank's binding to rank 0, which logs the table once; returns the list there."""
    everyone = world.mpi.gather(binding, root=0) if world.mpi is not None else [binding]
    if world.rank == 0:
        log.info("bindings:\n%s", report_table(everyone))
        return list(everyone)
    return []


def device_label(spec: DeviceSpec | None) -> str:
    """The DEVICES entry a rank drives as text (``?`` when DEVICES does not fit the job; reported later)."""
    return "?" if spec is None else str(spec)
