"""Slurm on the namespace nodes of tests/netns_cluster.py: slurmctld at the head, one slurmd inside each node.

The loopback cluster of tests/slurm_cluster.py runs two slurmd on 127.0.0.1; here every slurmd lives in its
node (its own hostname, address, PID and IPC namespaces), so ``srun``, the templates' ``mpiexec`` inside an
allocation and the jobs' ranks cross the veth links exactly as on a real cluster, and a node or link can be
killed under a running job.

- **munged** runs on the host with its socket in the cluster's folder, a path every namespace sees
  (``AuthInfo=socket=…``); its key is private to this cluster.
- **slurmctld** runs at the head (hostname ``head``, its address on the bridge), like mpiexec.
- **slurmd** runs inside each node, entered with ``nsenter``. Slurm 22.05's slurmd insists on cgroup mounts
  even with ``proctrack/linuxproc`` and ``task/none``: each node gets a tmpfs on ``/sys/fs/cgroup`` and a
  named cgroup-v1 hierarchy of its own (``name=<cluster><node>``) at ``/sys/fs/cgroup/systemd``, inside its
  private mount namespace, so the host's cgroups are untouched and the mounts vanish with the node.

Clients (``sbatch``, ``scontrol``, ``scancel``, ``sinfo``) run at the head. :meth:`NetnsSlurm.stop` stops
slurmctld and munged by pid; every slurmd and job process dies with its node when the cluster stops.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from netns_cluster import NetnsCluster
from netns_cluster import missing_reason as netns_missing
from slurm_cluster import SlurmCluster, daemon_lines, free_ports, read_pid, start_munge, stop_pid, tool
from slurm_cluster import missing_reason as slurm_missing

from parallel import sharing_env

START_TIMEOUT_S = 60.0


class NetnsSlurm(SlurmCluster):
    """A Slurm cluster whose nodes are the namespace nodes of ``cluster`` (the module docstring)."""

    def __init__(self, cluster: NetnsCluster) -> None:
        root = cluster.root / "slurm"
        super().__init__(root, root / "slurm.conf")
        self.cluster = cluster
        self.munge_pid_file: Path | None = None
        self.node_pids: dict[str, int] = {}

    # -- clients at the head ----------------------------------------------------------------------------

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A Slurm client command, run at the head."""
        return subprocess.run(
            self.cluster.head_command(list(args)), env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None, fresh: bool = False) -> int:
        """Submit a batch script at the head (from a fresh shell's environment plus ``env`` if ``fresh``)."""
        proc = subprocess.run(
            self.cluster.head_command(["sbatch", "--parsable", *args]),
            env=self.fresh_env(env) if fresh else {**self.env, **(env or {})},
            cwd=cwd, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.strip().split(";")[0])

    def shell(self, line: str, cwd: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """One bash command line typed at the head from a fresh login shell (a README line, verbatim)."""
        return subprocess.run(
            self.cluster.head_command(["bash", "-c", line]), cwd=cwd, env=self.fresh_env(),
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    # -- set-up and tear-down ---------------------------------------------------------------------------

    def start(self) -> NetnsSlurm:
        """munged, slurmctld and a slurmd per node; returns once every node is idle; on failure stops all."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.cluster.root.chmod(0o755)  # munged (user munge) must reach its socket folder
        self.root.mkdir()
        self.root.chmod(0o755)
        for sub in ("state", *(f"spool-{n}" for n in self.cluster.hosts)):
            (self.root / sub).mkdir()
        sock, self.munge_pid_file = start_munge(self.root)
        self._write_config(sock)
        path = os.environ.get("PATH", "/usr/bin:/bin")
        self.env = {"PATH": path, "SLURM_CONF": str(self.conf), **sharing_env()}
        started = [self.run(tool("slurmctld") or "slurmctld", "-f", str(self.conf))]
        started += [self._start_slurmd(name) for name in self.cluster.hosts]
        self._wait_idle(started)

    def _start_slurmd(self, name: str) -> subprocess.CompletedProcess[str]:
        """slurmd inside node ``name``, after the cgroup mounts it needs (the module docstring)."""
        script = (
            "mount -t tmpfs xbcgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
            f"mount -t cgroup -o none,name=xb{self.cluster.ident}{name} xbcgroup "
            f"/sys/fs/cgroup/systemd && exec {shlex.quote(tool('slurmd') or 'slurmd')} "
            f"-f {shlex.quote(str(self.conf))} -N {name}"
        )
        return subprocess.run(
            self.cluster.node_command(name, ["sh", "-c", script]), env=self.env, capture_output=True,
            text=True, timeout=30,
        )  # fmt: skip

    def _wait_idle(self, started: list[subprocess.CompletedProcess[str]]) -> None:
        """Return once every node is idle; raise with the daemons' output and logs after the timeout."""
        deadline = time.monotonic() + START_TIMEOUT_S
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if sorted(states) == sorted(self.cluster.hosts) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.3)
        logs = "".join(p.stderr for p in started)
        for log in sorted(self.root.glob("*.log")):
            logs += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"Slurm nodes not idle after {START_TIMEOUT_S:.0f} s: {states}\n{logs}")

    def heal(self, job: int, cancel: bool = True) -> None:
        """After a failure drill: boot every killed node again with its slurmd (slurmctld waits for a lost
        node's slurmd to end the job there), cancel ``job`` and wait for its end (unless not ``cancel``: a
        job that requeued itself), then for every node idle."""
        started = []
        for node in self.cluster.members:
            if node.pid == 0:
                self.cluster.restart_node(node.name)
                started.append(self._start_slurmd(node.name))
        if cancel:
            self.run("scancel", str(job))
            self.wait_job(job, timeout=120)
        self._wait_idle(started)

    def _write_config(self, munge_socket: Path) -> None:
        head = f"{self.cluster.subnet}.10"
        cpus = os.cpu_count() or 1
        port, node_port = free_ports(2)
        lines = [
            f"ClusterName=xbns{self.cluster.ident}",
            f"SlurmctldHost=head({head})",
            f"SlurmctldPort={port}",
            f"SlurmdPort={node_port}",  # one port for every slurmd: each node has its own address
            *daemon_lines(self.root, munge_socket),
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SlurmdParameters=config_overrides",
            # a lost node is noticed by the job itself (mpicrossbow's watchdog), not by Slurm's timeouts
            "SlurmdTimeout=300",
            f"FirstJobId={1_000_000 + int(self.cluster.ident) % 9_000_000}",
        ]
        for node in self.cluster.members:
            lines.append(f"NodeName={node.name} NodeAddr={node.address} CPUs={cpus} State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def stop(self) -> None:
        """Stop slurmctld and munged by pid (slurmd and the jobs die with their nodes); remove the folder."""
        if self.conf.exists():
            stop_pid(read_pid(self.root / "slurmctld.pid"))
        if self.munge_pid_file is not None:
            stop_pid(read_pid(self.munge_pid_file))
        shutil.rmtree(self.root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Start nodes with Slurm by hand, print how to submit into them, remove everything on Ctrl-C."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    parser.add_argument("--rate", default="", help="tbf rate on every link, e.g. 1gbit (default: line rate)")
    args = parser.parse_args(argv)
    reason = netns_missing() or slurm_missing()
    if reason:
        print(f"netns_slurm: {reason}", file=sys.stderr)
        return 2
    cluster = NetnsCluster(args.nodes, args.rate).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    slurm = None
    try:
        slurm = NetnsSlurm(cluster).start()
        at_head = shlex.join(cluster.head_command(["bash"]))
        print(
            f"{cluster.describe()}\n  Slurm: {slurm.run('sinfo', '-h').stdout.strip()}\n"
            f"  submit from a shell at the head: SLURM_CONF={slurm.conf} {at_head}\n"
            "    then e.g. VENV=$PWD/.venv sbatch --nodes=2 launch/slurm/multi-node.sbatch\n"
            "Ctrl-C removes it.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if slurm is not None:
            slurm.stop()
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
