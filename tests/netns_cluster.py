"""A real small cluster on this machine: nodes as Linux namespaces joined by virtual Ethernet links.

Each **node** is a process (its "holder", ``sleep infinity`` as PID 1) in its own network, PID, IPC, UTS and
mount namespaces: hostname ``node<i>``, one interface ``eth0`` with an address of a private /24 that exists
only inside these namespaces, its own ``/etc/hosts`` and its own ``/dev/shm``. With the PID and IPC namespaces
MPI sees separate hosts and moves data over the links (with a network namespace alone UCX would use shared
memory between "nodes"). The private ``/dev/shm`` (a tmpfs the holder mounts in its mount namespace, whose
propagation is private, so the mount reaches neither the host nor another node) keeps one node's MPI
segments out of every other node's and out of the host's, as on real machines; it goes with the node (a
killed or stopped node's segments are gone, a restarted node starts with an empty one).
The links are veth pairs to a bridge in a **switch** namespace; a rate (``tc tbf``) may be put on any node's
link, both ways, and a link may be set down. The **head** (``mpiexec``, ``srun``, the test's own commands)
runs in a namespace of its own on the same bridge with hostname ``head``, sharing the host's PID namespace
(a process in a sibling PID namespace cannot enter a node).

MPICH's hydra reaches the nodes through its ssh launcher with :attr:`NetnsCluster.launcher` as the
``-launcher-exec`` program: it drops ssh's options and runs the command inside the named node with
``nsenter``. :meth:`NetnsCluster.mpiexec` builds that command line.

Everything it makes is named with one per-cluster prefix and removed by :meth:`NetnsCluster.stop` (every
namespace by name, every holder by pid: killing a node's PID 1 kills every process in it), also when
:meth:`NetnsCluster.start` fails half way. :func:`leftovers` lists anything of any cluster still present.

By hand (as root): ``python tests/netns_cluster.py --nodes 3 [--rate 1gbit] [--seconds N]`` starts a
cluster, prints how to launch into it, and removes it on Ctrl-C (SIGINT), SIGTERM or SIGHUP (a closed
terminal; not under ``nohup``), after ``--seconds``, or when the start fails, then prints one line naming what
it removed. It installs its own SIGINT handler: a job put in the background by a non-interactive shell
inherits SIGINT ignored, where Python's KeyboardInterrupt never comes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

#: Every namespace, link and folder of a cluster starts with this (and the cluster's own id).
PREFIX = "xbc"
TOOLS = ("ip", "unshare", "nsenter", "tc")
COMMAND_TIMEOUT_S = 20.0
#: The failures :meth:`NetnsCluster.fail` injects, as the tests name them.
FAILURES = ("node killed", "link down", "link crawls")
#: Mount options of each node's private /dev/shm: half the memory at most, like the kernel's own tmpfs
#: default (a cap, not a reservation: pages are used only as segments are written), and a host's usual
#: /dev/shm mode and flags.
SHM_OPTIONS = "size=50%,mode=1777,nosuid,nodev"


def drill_settings(failure: str) -> tuple[str, ...]:
    """The job's overrides for a drill of ``failure``: a cut or crawling link is noticed by the watchdog's
    network probe after ``[watchdog] peer_timeout``, 5 s here instead of the default 20 (15 s less of a
    waiting test); a killed node keeps the default, so its drills still show the one-minute bound with it."""
    return () if failure == "node killed" else ("watchdog.peer_timeout=5",)


def missing_reason() -> str | None:
    """Why a namespace cluster cannot be started here, or None when it can."""
    if sys.platform != "linux":
        return "network-namespace nodes need Linux"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install -y iproute2 util-linux)"
    if os.geteuid() != 0:
        return "network-namespace nodes need root (ip netns, unshare)"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One set-up command, bounded; a failure raises with its stderr."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class Node:
    """One node: its name (= hostname), address, network namespace, holder pid and link ends."""

    name: str
    address: str
    netns: str
    pid: int = 0
    #: this node's end of its link, inside its namespace
    inside: str = "eth0"
    #: the switch's end of the link (in the switch namespace)
    port: str = ""


#: The idents this process has given out: a second cluster alive beside the shared one (a test's own) must
#: never take its names, or removing one removes the other's namespaces (seen in CI with 2-digit suffixes).
_GIVEN: set[str] = set()


def new_ident() -> str:
    """A cluster ident (this process's pid and a random suffix) no other cluster of this process was given
    and no namespace on the machine uses."""
    taken = {n for n in _netns_names() if n.startswith(PREFIX)}
    while True:
        ident = f"{os.getpid() % 10000}{random.randrange(1000):03d}"
        if ident not in _GIVEN and not any(n.startswith(f"{PREFIX}{ident}") for n in taken):
            _GIVEN.add(ident)
            return ident


@dataclass
class NetnsCluster:
    """``nodes`` nodes and a head on one bridge (the module docstring): :meth:`start`, then :meth:`stop`."""

    nodes: int = 2
    #: a tbf rate for every node's link (``1gbit``, ``300mbit``); empty: line rate
    rate: str = ""
    ident: str = field(default_factory=lambda: new_ident())
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix=f"{PREFIX}-")))
    members: list[Node] = field(default_factory=list)
    head_netns: str = ""
    switch: str = ""
    subnet: str = ""
    #: what :meth:`stop` has removed so far, one item each (``namespace N``, ``holder pid P (nodeI)``,
    #: ``folder F``), kept across calls: a failed :meth:`start` stops before its caller can ask
    removed: list[str] = field(default_factory=list)

    @property
    def hosts(self) -> list[str]:
        """The nodes' hostnames, in order."""
        return [n.name for n in self.members]

    @property
    def launcher(self) -> Path:
        """The ``-launcher-exec`` program: ``launcher [ssh options] NODE COMMAND...`` runs COMMAND in NODE."""
        return self.root / "launch-in-node"

    def node(self, name: str) -> Node:
        """The node named ``name``."""
        for n in self.members:
            if n.name == name:
                return n
        raise KeyError(f"no node {name} (nodes: {', '.join(self.hosts)})")

    # -- set-up and tear-down ---------------------------------------------------------------------------

    def start(self) -> NetnsCluster:
        """Make the switch, the head and the nodes; on any failure remove what was made and raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.subnet = f"10.{random.randrange(16, 250)}.{random.randrange(1, 250)}"
        self.switch = f"{PREFIX}{self.ident}sw"
        self.head_netns = f"{PREFIX}{self.ident}hd"
        names = [f"node{i + 1}" for i in range(self.nodes)]
        self.members = [
            Node(
                name,
                f"{self.subnet}.{i + 11}",
                f"{PREFIX}{self.ident}n{i + 1}",
                port=f"{PREFIX}{self.ident}p{i + 1}",
            )
            for i, name in enumerate(names)
        ]
        self.write_hosts(loopback=False)
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        _sh("ip", "-n", self.switch, "link", "set", "lo", "up")
        self._attach(self.head_netns, f"{PREFIX}{self.ident}ph", f"{self.subnet}.10")
        for n in self.members:
            self._attach(n.netns, n.port, n.address)
            n.pid = self._hold(n)
            if self.rate:
                self.set_rate(n.name, self.rate)
        self._write_launcher()

    def hosts_file(self, host: str) -> Path:
        """The /etc/hosts that ``host`` (a node's name or ``head``) sees."""
        return self.root / f"hosts-{host}"

    def write_hosts(self, loopback: bool) -> None:
        """Every host's /etc/hosts: the head's and nodes' addresses; with ``loopback`` each node's own name
        first on 127.0.1.1, as Debian writes it (rewritten in place: running nodes see it at once)."""
        common = ["127.0.0.1 localhost", f"{self.subnet}.10 head"]
        common += [f"{n.address} {n.name}" for n in self.members]
        for host in ["head", *self.hosts]:
            own = [f"127.0.1.1 {host}"] if loopback and host != "head" else []
            self.hosts_file(host).write_text("\n".join([*own, *common]) + "\n", encoding="utf-8")

    def _attach(self, netns: str, port: str, address: str) -> None:
        """A namespace ``netns`` with ``eth0`` at ``address``, linked to the bridge through ``port``."""
        _sh("ip", "netns", "add", netns)
        _sh(
            "ip",
            "link",
            "add",
            port,
            "netns",
            self.switch,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            netns,
        )
        _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        _sh("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _sh("ip", "-n", netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", netns, "link", "set", "lo", "up")

    def _hold(self, n: Node) -> int:
        """Start the node's holder (PID 1 of its PID namespace) and return its pid as the host sees it.

        Its mount namespace has private propagation (``--propagation private``, said rather than left to
        unshare's default), so the node's own /etc/hosts and its own tmpfs on /dev/shm (:data:`SHM_OPTIONS`)
        stay inside the node and vanish with it. ``--kill-child``: the holder dies with its ``unshare``
        parent, so killing either pid removes the node."""
        script = (
            f"hostname {n.name} && mount --bind {shlex.quote(str(self.hosts_file(n.name)))} /etc/hosts "
            f"&& mount -t tmpfs -o {SHM_OPTIONS} shm /dev/shm && exec sleep infinity"
        )
        proc = subprocess.Popen(
            ["ip", "netns", "exec", n.netns, "unshare", "--fork", "--kill-child", "--pid", "--ipc", "--uts",
             "--mount", "--propagation", "private", "--mount-proc", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        (self.root / f"{n.name}.launcher-pid").write_text(str(proc.pid), encoding="utf-8")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while time.monotonic() < deadline:
            pid = _child_sleep(proc.pid)
            if pid and _hostname_of(pid) == n.name:
                (self.root / f"{n.name}.pid").write_text(str(pid), encoding="utf-8")
                return pid
            if proc.poll() is not None:
                raise RuntimeError(f"{n.name}: the holder ended: {proc.stderr.read().decode().strip()}")
            time.sleep(0.01)
        raise RuntimeError(f"{n.name}: the holder did not start within {COMMAND_TIMEOUT_S:g} s")

    def _write_launcher(self) -> None:
        pids = " ".join(f"{n.name}={n.pid}" for n in self.members)
        self.launcher.write_text(
            f"""#!/bin/sh
# hydra's ssh launcher: [ssh options] NODE COMMAND... -> COMMAND inside NODE (namespace cluster {self.ident})
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
node="$1"; shift
pid=""
for pair in {pids}; do [ "${{pair%%=*}}" = "$node" ] && pid="${{pair#*=}}"; done
[ -n "$pid" ] || {{ echo "launch-in-node: no node $node in cluster {self.ident}" >&2; exit 255; }}
exec nsenter -t "$pid" -n -u -i -p -m --wd="$PWD" -- sh -c "$*"
""",
            encoding="utf-8",
        )
        self.launcher.chmod(0o755)

    def stop(self) -> list[str]:
        """Remove everything this cluster made and return what was there, one item each (also added to
        :attr:`removed`; a second call finds nothing more).

        Holders by pid: the recorded ones and any process still running a holder script of this cluster's
        folder (a start cut short between starting a holder and recording it); killing a node's holder
        takes every process of the node and its private /dev/shm with it. Namespaces by name: every one of
        this cluster's ident (:meth:`_own_netns`), recorded or not. Then its folder."""
        found: list[str] = []
        pids: dict[int, str] = {}
        for n in self.members:
            for pid in (n.pid, _read_int(self.root / f"{n.name}.launcher-pid")):
                if pid:
                    pids.setdefault(pid, n.name)
        for pid, name in _holder_processes(self.root).items():
            pids.setdefault(pid, name)
        for pid, name in pids.items():
            if _kill(pid):
                found.append(f"holder pid {pid} ({name})")
        for netns in self._own_netns():
            if _sh("ip", "netns", "del", netns, check=False).returncode == 0:
                found.append(f"namespace {netns}")
        if self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)
            found.append(f"folder {self.root}")
        self.removed += found
        return found

    def _own_netns(self) -> list[str]:
        """This cluster's namespaces present now: its switch, head and nodes, found by name. The ident is
        digits and every suffix starts with a letter, so another cluster's names never match."""
        own = re.compile(rf"{re.escape(PREFIX + self.ident)}(sw|hd|n\d+)")
        return [n for n in _netns_names() if own.fullmatch(n)]

    # -- running things ---------------------------------------------------------------------------------

    def head_command(self, argv: list[str]) -> list[str]:
        """``argv`` run at the head: its network namespace, hostname ``head`` and the cluster's hosts file,
        in the host's PID namespace (so that hydra's launcher can enter the nodes)."""
        script = (
            f"hostname head && mount --bind {shlex.quote(str(self.hosts_file('head')))} /etc/hosts "
            f"&& exec {shlex.join(argv)}"
        )
        return ["ip", "netns", "exec", self.head_netns, "unshare", "--uts", "--mount", "sh", "-c", script]

    def node_command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``name`` (in the current folder)."""
        pid = self.node(name).pid
        return ["nsenter", "-t", str(pid), "-n", "-u", "-i", "-p", "-m", f"--wd={os.getcwd()}", "--", *argv]

    def mpiexec(self, mpiexec: str, ranks_per_node: int, argv: list[str], nodes: int = 0) -> list[str]:
        """An MPICH (hydra) command line at the head: ``ranks_per_node`` ranks on each of the first ``nodes``
        nodes (all by default), launched into them through :attr:`launcher`."""
        hosts = self.hosts[: nodes or len(self.members)]
        inner = [
            mpiexec, "-launcher", "ssh", "-launcher-exec", str(self.launcher),
            "-hosts", ",".join(f"{h}:{ranks_per_node}" for h in hosts),
            "-n", str(ranks_per_node * len(hosts)), *argv,
        ]  # fmt: skip
        return self.head_command(inner)

    def link_bytes(self, name: str) -> tuple[int, int]:
        """Bytes node ``name`` has sent and received on its link (its ``eth0`` counters)."""
        out = _sh("ip", "-n", self.node(name).netns, "-s", "-j", "link", "show", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def set_rate(self, name: str, rate: str, latency: str = "20ms", burst: str = "512kb") -> None:
        """Limit node ``name``'s link to ``rate`` both ways (tbf on its eth0 and on its switch port); a packet
        that would wait longer than ``latency`` in the queue is dropped. ``burst`` is the token bucket: that
        many bytes after a quiet moment go at the line's own rate, so a bucket larger than a few messages
        caps the link's average rate rather than each message's (a small one, ``8kb``, is a link of that
        rate)."""
        n = self.node(name)
        for netns, dev in ((n.netns, n.inside), (self.switch, n.port)):
            tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
            _sh("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)

    def clear_rate(self, name: str) -> None:
        """Line rate again on node ``name``'s link (no qdisc left to remove is fine)."""
        n = self.node(name)
        for netns, dev in ((n.netns, n.inside), (self.switch, n.port)):
            _sh("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def set_link(self, name: str, up: bool) -> None:
        """Take node ``name``'s link down (or up again) at the switch: the node no longer reaches anyone."""
        _sh("ip", "-n", self.switch, "link", "set", self.node(name).port, "up" if up else "down")

    def kill_node(self, name: str) -> None:
        """Kill every process of node ``name`` at once (its PID 1, the holder, takes them all), as a node that
        loses power; :meth:`restart_node` brings it back."""
        n = self.node(name)
        _kill(_read_int(self.root / f"{n.name}.launcher-pid"))  # the holder's parent, which reaps it
        _kill(n.pid)
        n.pid = 0

    def restart_node(self, name: str) -> None:
        """A fresh holder for node ``name`` (same namespace, address and link): the node boots again."""
        n = self.node(name)
        if n.pid:
            self.kill_node(name)
        n.pid = self._hold(n)
        self._write_launcher()

    def fail(self, name: str, failure: str) -> None:
        """Inject one of :data:`FAILURES` on node ``name``: ``link down`` (cut at the switch), ``link crawls``
        (8 kbit/s both ways) or ``node killed`` (every process at once); :meth:`heal` undoes it."""
        if failure == "link down":
            self.set_link(name, up=False)
        elif failure == "link crawls":
            self.set_rate(name, "8kbit")
        elif failure == "node killed":
            self.kill_node(name)
        else:
            raise ValueError(f"no failure {failure!r}: use one of {', '.join(FAILURES)}")

    def heal(self, name: str, boot: bool = True) -> None:
        """Undo :meth:`fail` on node ``name``: its link up at line rate and, with ``boot``, the node booted
        again if it was killed (a cluster with daemons of its own boots them with theirs: ``boot=False``)."""
        self.set_link(name, up=True)
        self.clear_rate(name)
        if boot and self.node(name).pid == 0:
            self.restart_node(name)
        self.wait_reachable(name)

    def wait_reachable(self, name: str, timeout: float = 10.0) -> None:
        """Wait until node ``name`` reaches the head again: a TCP connection to a port nobody listens on
        is refused (the head answered) rather than unreachable. A job started sooner after a healed link
        or a rebooted node can meet "No route to host" while the neighbour entries settle."""
        probe = (
            "import socket, sys, time\n"
            f"deadline = time.monotonic() + {timeout}\n"
            "while time.monotonic() < deadline:\n"
            "    try:\n"
            f"        socket.create_connection(('{self.subnet}.10', 9), timeout=0.5).close()\n"
            "        sys.exit(0)\n"
            "    except ConnectionRefusedError:\n"
            "        sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.1)\n"
            "sys.exit(1)\n"
        )
        netns = self.node(name).netns
        done = subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, "-c", probe], timeout=timeout + 5
        )
        if done.returncode:
            raise RuntimeError(
                f"{name} does not reach the head ({self.subnet}.10) {timeout:g} s after healing"
            )

    def describe(self) -> str:
        """How to use this cluster by hand."""
        nodes = ", ".join(f"{n.name} {n.address} (pid {n.pid})" for n in self.members)
        example = shlex.join(self.mpiexec("mpiexec", 1, ["hostname"]))
        return (
            f"namespace cluster {self.ident}: {nodes}; head {self.subnet}.10\n"
            f"  a shell in a node:  {shlex.join(self.node_command(self.hosts[0], ['bash']))}\n"
            f"  a shell at the head: {shlex.join(self.head_command(['bash']))}\n"
            f"  MPI across nodes:   {example}"
        )


def _netns_names() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0


def _kill(pid: int) -> bool:
    """SIGKILL ``pid`` and wait (up to 5 s) until it is gone; True when it was there to kill."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        try:  # our own child: reap it; otherwise wait for its parent to
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.01)
    return True


def _child_sleep(pid: int) -> int:
    """The pid (host's view) of the ``sleep`` the holder chain under ``pid`` ended in, or 0."""
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() == "sleep":
                return p
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    return 0


def _hostname_of(pid: int) -> str:
    try:
        return subprocess.run(
            ["nsenter", "-t", str(pid), "-u", "hostname"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _holder_processes(root: Path) -> dict[int, str]:
    """pid → node name of the processes running a holder script of the cluster whose folder is ``root``
    (its ``unshare``, or the script before it execs ``sleep``), with the ``sleep`` each has become."""
    marker = f"{root}/hosts-".encode()
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmd and b"mount --bind" in cmd:
            name = cmd.split(marker, 1)[1].split(b" ", 1)[0].decode(errors="replace").strip("'")
            found[int(proc.name)] = name
            sleep = _child_sleep(int(proc.name))
            if sleep:
                found.setdefault(sleep, name)
    return found


def leftovers() -> list[str]:
    """Anything a namespace cluster made that still exists: namespaces, folders, holder processes, and the
    Slurm and munge daemons that tests/netns_slurm.py runs for it."""
    found = [f"namespace {n}" for n in _netns_names() if n.startswith(PREFIX)]
    found += [f"folder {p}" for p in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*")]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            daemon = any(d in cmd for d in ("munged", "slurmctld", "slurmd"))  # tests/netns_slurm.py
            if f"/{PREFIX}-" in cmd and ("mount --bind" in cmd or daemon):
                found.append(f"process {proc.name}: {cmd.strip()[:120]}")
    return found


class Signalled(BaseException):
    """Raised by :func:`_on_signal` out of whatever :func:`main` was doing (waiting, or half way through
    :meth:`NetnsCluster.start`, which then removes what it made): a BaseException, so that no ``except
    Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.name = signal.Signals(signum).name


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Signalled(signum)


def _stop_signals() -> list[signal.Signals]:
    """The signals that remove a cluster started by hand: SIGINT and SIGTERM always (SIGINT even where the
    parent left it ignored: a background job of a non-interactive shell), SIGHUP unless ignored
    (``nohup`` asks the cluster to outlive the terminal)."""
    wanted = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        wanted.append(signal.SIGHUP)
    return wanted


@contextlib.contextmanager
def started(cluster: NetnsCluster) -> Iterator[NetnsCluster]:
    """Start ``cluster`` for the ``with`` block and remove it when the block ends, also when the process is
    sent SIGINT, SIGTERM or SIGHUP (a benchmark stopped by hand or by ``timeout``): without this a SIGTERM
    ended the process before any ``finally`` ran and left the namespaces and node holders behind. After a
    signal, one line names what was removed and the process exits with 128 + the signal's number."""
    signals = _stop_signals()
    previous = {s: signal.signal(s, _on_signal) for s in signals}
    try:
        cluster.start()
        yield cluster
    except Signalled as sig:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        cluster.stop()
        print(removal_line(cluster.removed, sig.name), file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.Signals[sig.name].value) from None
    finally:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def removal_line(removed: list[str], why: str) -> str:
    """One line saying what a stop removed (items as :meth:`NetnsCluster.stop` words them), and why."""
    namespaces = [item.split(" ", 1)[1] for item in removed if item.startswith("namespace ")]
    folders = [item.split(" ", 1)[1] for item in removed if item.startswith("folder ")]
    holders: dict[str, list[str]] = {}
    for item in removed:
        if item.startswith("holder pid "):
            pid, node = item.removeprefix("holder pid ").split(" ", 1)
            holders.setdefault(node.strip("()"), []).append(pid)
    parts = []
    if holders:
        pids = ", ".join(f"{node} {' '.join(p)}" for node, p in holders.items())
        parts.append(f"holder pids {pids} (each node's processes and /dev/shm with them)")
    if namespaces:
        parts.append(f"namespaces {' '.join(namespaces)}")
    if folders:
        parts.append(f"folder {' '.join(folders)}")
    return f"netns_cluster: {why}: removed {'; '.join(parts) if parts else 'nothing (nothing was left)'}"


def main(argv: list[str] | None = None) -> int:
    """Start a cluster by hand, print how to use it; remove it on SIGINT, SIGTERM or SIGHUP, after
    ``--seconds``, or when the start fails, and print one line naming what was removed.

    The handlers are installed before anything is made, so a signal during the start removes the half-made
    cluster too, and set to ignore once the removal begins, so a second Ctrl-C cannot cut it short.
    Exit status 0 after a signal or ``--seconds`` (the ways to end it), 1 when the start failed, 2 when a
    cluster cannot be made here."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    parser.add_argument("--rate", default="", help="tbf rate on every link, e.g. 1gbit (default: line rate)")
    parser.add_argument(
        "--seconds", type=float, default=0.0, help="remove it after this long (default: on a signal)"
    )
    args = parser.parse_args(argv)
    reason = missing_reason()
    if reason:
        print(f"netns_cluster: {reason}", file=sys.stderr)
        return 2
    signals = _stop_signals()
    previous = {s: signal.signal(s, _on_signal) for s in signals}
    cluster: NetnsCluster | None = None
    status, why = 0, "stopped"
    try:
        cluster = NetnsCluster(args.nodes, args.rate)
        started = time.perf_counter()
        cluster.start()
        print(
            f"up in {time.perf_counter() - started:.2f} s\n{cluster.describe()}\n"
            f"Ctrl-C or SIGTERM (kill {os.getpid()}) removes it.",
            flush=True,
        )
        if args.seconds > 0:
            time.sleep(args.seconds)
            why = f"{args.seconds:g} s are over"
        else:
            while True:
                time.sleep(3600)
    except Signalled as sig:
        why = sig.name
    except Exception as error:
        status, why = 1, f"the start failed ({error})"
    finally:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        if cluster is not None:
            cluster.stop()
            try:
                print(removal_line(cluster.removed, why), flush=True)
            except OSError:  # stdout gone with the terminal: the removal itself is done
                pass
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status


if __name__ == "__main__":
    sys.exit(main())
