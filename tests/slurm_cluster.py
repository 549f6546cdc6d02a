"""A real, private Slurm cluster for tests: munged, slurmctld and two slurmd emulating nodes n1 and n2.

Everything lives in one temporary folder (config, state, spool, logs, munge socket and key) and uses free
TCP ports, so it neither needs nor touches a system Slurm and can run beside another test session. Needs
root (slurmd runs jobs as their user) and Debian's ``slurmctld slurmd slurm-client munge`` packages; the
fixture skips with the reason otherwise. Every command has a timeout; teardown stops the daemons it
started by their pids and kills any slurmstepd left behind by this cluster's jobs.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from parallel import sharing_env

DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
CLIENTS = ("sbatch", "sinfo", "scontrol", "squeue", "sacct", "srun")
NODES = ("n1", "n2")
GPUS_PER_NODE = 2
START_TIMEOUT_S = 60.0


def tool(name: str) -> str | None:
    """Path of a Slurm or munge program, from PATH or the Debian location of daemons."""
    found = shutil.which(name)
    if found:
        return found
    path = DAEMONS.get(name)
    return path if path and os.access(path, os.X_OK) else None


def missing_reason() -> str | None:
    """Why a private Slurm cannot be started here, or None when it can."""
    missing = [n for n in (*DAEMONS, *CLIENTS[:3], "srun") if tool(n) is None]
    if missing:
        return (
            f"Slurm is not installed (missing {', '.join(missing)}); "
            "apt-get install -y slurmctld slurmd slurm-client munge"
        )
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd starts jobs as their user)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the munge user does not exist (install Debian's munge package)"
    return None


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports that are free now (bound briefly to port 0, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class SlurmCluster:
    """A running private cluster: its folder, config file and the environment its clients need."""

    root: Path
    conf: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        """Node name → state as sinfo shows it (``idle``, ``alloc``, ``down*``, ...)."""
        proc = self.run("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)

    def fresh_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A fresh login shell's environment on this cluster: system PATH, HOME, SLURM_CONF, the suite's
        core-sharing settings (:func:`parallel.sharing_env`: what a shared machine's profile would set),
        ``extra``."""
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": os.environ.get("HOME", "/")}
        return {**base, "SLURM_CONF": str(self.conf), **sharing_env(), **(extra or {})}

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None, fresh: bool = False) -> int:
        """Submit a batch script (from a fresh shell's environment plus ``env`` if ``fresh``); its job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            env=self.fresh_env(env) if fresh else {**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty once Slurm forgot the job)."""
        proc = self.run("scontrol", "-o", "show", "job", str(job))
        return dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)

    def wait_job(self, job: int, timeout: float, start_requeued: bool = False) -> dict[str, str]:
        """Poll until ``job`` ends (bounded by ``timeout``); its final ``scontrol show job`` record. With
        ``start_requeued``, a requeued ``job`` is started at once (Slurm holds one back about 2 minutes)."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        started = 0
        while time.monotonic() < deadline:
            record = self.job(job)
            state = record.get("JobState", state)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return record
            restarts = int(record.get("Restarts", "0"))
            if start_requeued and state == "PENDING" and restarts > started:
                self.start_requeued(job)
                started = restarts
            time.sleep(1)
        self.run("scancel", str(job))
        raise TimeoutError(f"Slurm job {job} still {state} after {timeout:.0f} s (cancelled)")

    def start_requeued(self, job: int) -> None:
        """Start the requeued ``job`` now instead of Slurm's ~2 minutes later, once its nodes are done
        completing its first run."""
        wait_for(lambda: "comp" not in self.node_states().values(), 60, "the nodes done completing")
        time.sleep(2)  # slurmd refuses a credential from the same second as the first run's revocation
        self.run("scontrol", "update", f"jobid={job}", "StartTime=now")


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate()`` every 0.2 s until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail(f"not within {timeout:.0f} s: {what}")


def ranks_of(marker: Path) -> list[int]:
    """Pids of rank processes (on any node: their PID namespaces are children of this one) whose command line
    names ``marker`` (a test's own output folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(marker).encode() in cmdline and b"crossbow" in cmdline:
            pids.append(int(entry.name))
    return pids


def daemon_lines(root: Path, munge_socket: Path) -> list[str]:
    """The slurm.conf lines every private cluster shares: root daemons, munge at ``munge_socket``, state,
    spool, pid and log files under ``root`` (``%n``: the node's name), cores as the consumable resource, no
    MPI plugin unless a job asks, a lost node back in service once it registers, a scheduler pass every
    second, no accounting."""
    return [
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool-%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        "SchedulerParameters=sched_interval=1",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
    ]


def write_config(root: Path, host: str, ports: list[int], munge_socket: Path) -> Path:
    """slurm.conf for a two-node cluster on this host (nodes n1, n2 on their own ports)."""
    cpus = os.cpu_count() or 1
    lines = [
        "ClusterName=xbowtest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        *daemon_lines(root, munge_socket),
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/affinity",
        # Job ids of their own: MPICH names its shared memory after the job and step, and a segment a killed
        # job left behind must not meet a later test session's job of the same id.
        f"FirstJobId={random.randrange(100_000, 10_000_000)}",
    ]
    # Two GPUs per node as a generic resource without device files: enough for Slurm to hand them out and
    # set SLURM_GPUS_ON_NODE, so the GPU template's allocation logic runs (no CUDA is touched).
    lines.append("GresTypes=gpu")
    for gpu in range(GPUS_PER_NODE):
        (root / f"gpu{gpu}").touch()
    (root / "gres.conf").write_text(f"Name=gpu File={root}/gpu[0-{GPUS_PER_NODE - 1}]\n")
    for name, port in zip(NODES, ports[1:], strict=True):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
            f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP")
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def start_munge(root: Path) -> tuple[Path, Path]:
    """A private munged (own key, socket, pid file); returns (socket path, pid file)."""
    munge = root / "munge"
    munge.mkdir()
    munge.chmod(0o755)  # munged wants its socket folder searchable by all
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    user = pwd.getpwnam("munge")
    for path in (munge, key):
        os.chown(path, user.pw_uid, user.pw_gid)
    sock, pid = munge / "munge.socket", munge / "munged.pid"
    subprocess.run(
        [
            *("runuser", "-u", "munge", "--", tool("munged") or "munged"),
            *(f"--socket={sock}", f"--key-file={key}", f"--pid-file={pid}"),
            *(f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return sock, pid


def read_pid(path: Path) -> int | None:
    """The pid in a pid file, or None."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (and is not a zombie)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def stop_pid(pid: int | None, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds, one process by its id."""
    if pid is None or not alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


def stepds_of(conf: Path) -> list[int]:
    """Pids of slurmstepd processes that belong to the cluster configured by ``conf``."""
    pids = []
    marker = f"SLURM_CONF={conf}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith("slurmstepd"):
                continue
            if marker in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd n1 and n2; yield once both nodes are idle; stop them all."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="xbow-slurm-"))
    root.chmod(0o755)
    for sub in ("state", *(f"spool-{n}" for n in NODES)):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    munge_socket, munge_pid = start_munge(root)
    conf = write_config(root, host, free_ports(1 + len(NODES)), munge_socket)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
        del env[key]
    cluster = SlurmCluster(root, conf, env)
    started: list[subprocess.CompletedProcess[str]] = []
    try:
        started.append(cluster.run(tool("slurmctld") or "slurmctld", "-f", str(conf)))
        for node in NODES:
            started.append(cluster.run(tool("slurmd") or "slurmd", "-f", str(conf), "-N", node))
        deadline = time.monotonic() + START_TIMEOUT_S
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = cluster.node_states()
            if sorted(states) == sorted(NODES) and all(s == "idle" for s in states.values()):
                break
            time.sleep(0.5)
        else:
            logs = "".join(p.stderr for p in started)
            for log in sorted(root.glob("*.log")):
                logs += f"\n--- {log.name}\n" + log.read_text()[-1500:]
            pytest.fail(f"Slurm nodes not idle after {START_TIMEOUT_S:.0f} s: {states}\n{logs}")
        yield cluster
    finally:
        try:
            cluster.run("scontrol", "shutdown", timeout=20)
        except subprocess.SubprocessError:
            pass
        for pid_file in [root / "slurmctld.pid", *(root / f"slurmd-{n}.pid" for n in NODES)]:
            stop_pid(read_pid(pid_file))
        for pid in stepds_of(conf):
            os.kill(pid, signal.SIGKILL)
        stop_pid(read_pid(munge_pid))
        shutil.rmtree(root, ignore_errors=True)
