"""Start an MPI job from a plain process: one rank per DEVICES entry, with the installed MPI's launcher.

This is what Theano-MPI's ``tmlauncher`` did: ``crossbow-launch -cfg session.cfg`` run without ``mpirun``
re-runs itself under ``mpiexec -n <len(DEVICES)>`` and returns the job's exit status. The launcher is the
one next to the running interpreter (the pip MPI wheel puts it there), else the first on PATH.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ..errors import USAGE_EXIT_CODE, UsageError
from .devices import DeviceSpec, any_size
from .failure import say
from .lost_hosts import lost_hosts, lost_line
from .reaper import awaiting_orphans
from .shm_hygiene import removing_new_segments
from .slurm import in_slurm_allocation

log = logging.getLogger(__name__)


def find_mpiexec() -> str:
    """Path of the MPI launcher to use; UsageError explains how to get one when none exists."""
    here = Path(sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        if (here / name).is_file():
            return str(here / name)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise UsageError(
            "no MPI launcher (mpiexec/mpirun) found next to the Python interpreter or on PATH; install one "
            "(pip install 'mpicrossbow[mpich]') or load your cluster's MPI module"
        )
    return found


def mpi_flavor(mpiexec: str) -> str:
    """``openmpi``, ``mpich`` (Hydra) or ``unknown``, from the launcher's ``--version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if "Open MPI" in out or "OpenRTE" in out or "PRRTE" in out:
        return "openmpi"
    if "HYDRA" in out or "MPICH" in out or "Intel" in out:
        return "mpich"
    return "unknown"


def installed_flavor() -> str:
    """The flavor of the MPI installed here (``unknown`` when no launcher is found): what srun's ``--mpi``
    must match."""
    try:
        return mpi_flavor(find_mpiexec())
    except UsageError:
        return "unknown"


def read_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """(host, slots) pairs from a hostfile in Open MPI (``host slots=4``) or MPICH (``host:4``) syntax.

    Blank lines and ``#`` comments are skipped; a host without a count has one slot. Anything else is a
    UsageError naming the file and line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"-hostfile {path}: cannot read it: {exc.strerror or exc}") from None
    hosts: list[tuple[str, int]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(
            r"([A-Za-z0-9_.\-]+)(?::(\d+)|\s+slots\s*=\s*(\d+))?(\s+max_slots\s*=\s*\d+)?", line
        )
        if match is None:
            raise UsageError(
                f"-hostfile {path} line {lineno}: cannot parse {line!r}; expected 'host', 'host slots=N' or "
                "'host:N'"
            )
        slots = int(match.group(2) or match.group(3) or 1)
        if slots < 1:
            raise UsageError(f"-hostfile {path} line {lineno}: {match.group(1)} has {slots} slots")
        hosts.append((match.group(1), slots))
    if not hosts:
        raise UsageError(f"-hostfile {path}: names no host")
    return hosts


def host_counts(
    devices: Sequence[DeviceSpec], hostfile: Sequence[tuple[str, int]] | None
) -> list[tuple[str, int]]:
    """(host, ranks) in order from DEVICES' host names or from a hostfile; empty when neither names hosts."""
    hosts = [d.host for d in devices]
    if any(hosts):
        if not all(hosts):
            raise UsageError("DEVICES: give a host for every entry or for none (host:cuda0,cuda1 form)")
        if hostfile:
            raise UsageError("DEVICES names hosts and -hostfile was given too; use one of them")
        counts = Counter(hosts)
        return [(h, counts[h]) for h in dict.fromkeys(hosts)]  # type: ignore[index]
    if not hostfile:
        return []
    slots = sum(n for _, n in hostfile)
    if slots < len(devices):
        raise UsageError(f"the hostfile has {slots} slot(s) but the job needs {len(devices)} rank(s)")
    return list(hostfile)


#: Open MPI (PRRTE) options that make a job's spawned jobs recoverable as ``--with-ft ulfm`` makes the job
#: itself: a replacement's death is then a loss the survivors handle, not a failed job at mpiexec's end.
RECOVERABLE_SPAWNS = ("--prtemca", "state_base_recoverable", "1")


def spawn_command(
    mpiexec: str,
    flavor: str,
    devices: Sequence[DeviceSpec],
    args: Sequence[str],
    hostfile: Sequence[tuple[str, int]] | None = None,
    bind: str = "none",
    fault_tolerant: bool = False,
) -> list[str]:
    """The launcher command: one rank per device, on the hosts that DEVICES or a hostfile names.

    Open MPI binds ranks itself by default; when mpicrossbow binds (``bind`` other than none) it is told
    ``--bind-to none`` so the two do not fight. Hydra (MPICH) binds nothing unless asked. ``fault_tolerant``
    (``[elastic] enabled`` true or auto) starts Open MPI with ``--with-ft ulfm``, without which a lost rank
    ends its job, and makes the jobs its ranks spawn recoverable too (``state_base_recoverable``: a
    ``[elastic] replace`` replacement that dies in turn would otherwise make mpiexec exit 137 at the end,
    although every rank finished); Hydra has no such mode (its ranks then say so, and ``elastic = true``
    stops there).
    """
    cmd = [mpiexec, "-n", str(len(devices))]
    if fault_tolerant and flavor == "openmpi":
        cmd += ["--with-ft", "ulfm", *RECOVERABLE_SPAWNS]
    hosts = host_counts(devices, hostfile)
    if hosts:
        spec = ",".join(f"{h}:{n}" for h, n in hosts)
        cmd += ["--host", spec] if flavor == "openmpi" else ["-hosts", spec]
    if flavor == "openmpi" and bind != "none":
        cmd += ["--bind-to", "none"]
    return [*cmd, sys.executable, "-m", "mpicrossbow.cli", *args]


def srun_command(
    flavor: str,
    devices: Sequence[DeviceSpec],
    args: Sequence[str],
    hostfile: Sequence[tuple[str, int]] | None = None,
    bind: str = "none",
    srun: str = "srun",
) -> list[str]:
    """``srun`` inside a Slurm allocation: PMI-2 for MPICH, PMIx for Open MPI, one task per device.

    Hosts (from DEVICES or a hostfile) become ``--nodelist`` with as many tasks on each; Slurm's own CPU
    binding is switched off when mpicrossbow binds.
    """
    cmd = [srun, f"--mpi={'pmix' if flavor == 'openmpi' else 'pmi2'}", "-n", str(len(devices))]
    hosts = host_counts(devices, hostfile)
    if hosts:
        per_node = {n for _, n in hosts}
        if len(per_node) != 1:
            raise UsageError("srun starts the same number of ranks on every host; the hosts given differ")
        cmd += ["-N", str(len(hosts)), f"--nodelist={','.join(h for h, _ in hosts)}"]
        cmd += [f"--ntasks-per-node={per_node.pop()}"]
    if bind != "none":
        cmd += ["--cpu-bind=none"]
    return [*cmd, sys.executable, "-m", "mpicrossbow.cli", *args]


def spawn_env(flavor: str, ranks: int) -> dict[str, str]:
    """Environment for the job: Open MPI allowed as root and oversubscribed when ranks exceed cores."""
    env = dict(os.environ)
    if flavor == "openmpi":
        if os.geteuid() == 0:
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        if ranks > (os.cpu_count() or 1):
            env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    return env


def run_job(cmd: Sequence[str], env: dict[str, str]) -> int:
    """Run the launcher, forwarding SIGINT/SIGTERM to it, and return its exit status (128+N for signal N)."""
    log.info("starting: %s", " ".join(cmd))
    proc = subprocess.Popen(list(cmd), env=env)

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - handler above normally catches it
                forward(signal.SIGINT, None)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def default_ranks(environ: dict[str, str] | None = None) -> int:
    """Ranks for ``DEVICES=cpu``: the allocation's tasks inside Slurm, else this process's usable cores."""
    environ = dict(os.environ) if environ is None else environ
    tasks = environ.get("SLURM_NTASKS", "")
    if "SLURM_JOB_ID" in environ and tasks.isdigit():
        return int(tasks)
    return len(os.sched_getaffinity(0))


def expand_devices(devices: Sequence[DeviceSpec], ranks: int | None) -> list[DeviceSpec]:
    """One entry per rank to start: the list itself, or ``ranks`` (default: usable cores) for ``cpu``."""
    if any_size(tuple(devices)):
        return list(devices) * (ranks or default_ranks())
    if ranks is not None and ranks != len(devices):
        raise UsageError(f"-np {ranks} does not match DEVICES, which lists {len(devices)} device(s)")
    return list(devices)


def spawn(
    devices: Sequence[DeviceSpec],
    args: Sequence[str],
    ranks: int | None = None,
    hostfile: str | None = None,
    bind: str = "none",
    launcher: str = "auto",
    fault_tolerant: bool = False,
) -> int:
    """Start the job for ``devices`` running ``crossbow-launch args`` on every rank; return its status.

    ``launcher``: ``mpiexec``, ``srun``, or ``auto`` (srun inside a Slurm allocation when it exists). It
    returns once the job's last process has ended (:mod:`~mpicrossbow.launch.reaper`), having removed the
    shared-memory segments the job's MPI left in this node's ``/dev/shm`` (a failed job leaves one):
    :mod:`~mpicrossbow.launch.shm_hygiene`. ``fault_tolerant``: see :func:`spawn_command`.
    """
    hosts = read_hostfile(hostfile) if hostfile else None
    if any_size(tuple(devices)) and ranks is None and hosts:
        ranks = sum(n for _, n in hosts)
    devices = expand_devices(devices, ranks)
    srun = shutil.which("srun")
    use_srun = launcher == "srun" or (launcher == "auto" and in_slurm_allocation() and srun is not None)
    if use_srun:
        if srun is None:
            raise UsageError("-launcher srun: srun is not on PATH")
        flavor = installed_flavor()
        cmd, env = srun_command(flavor, devices, args, hosts, bind, srun), dict(os.environ)
    else:
        mpiexec = find_mpiexec()
        flavor = mpi_flavor(mpiexec)
        cmd = spawn_command(mpiexec, flavor, devices, args, hosts, bind, fault_tolerant)
        env = spawn_env(flavor, len(devices))
    env.update(terminal_env())
    with removing_new_segments(), awaiting_orphans():
        status = run_job(cmd, env)
    named = [host for host, _ in host_counts(devices, hosts)]
    if not use_srun and len(named) > 1 and status not in QUIET_STATUSES:
        lost = lost_hosts(named, env)
        if lost:
            say(lost_line(status, lost))
    return status


#: Exit statuses after which the hosts of a failed job are not asked whether they answer: done, bad input,
#: stopped by a signal (checkpoint saved), interrupted from the terminal or by SIGTERM.
QUIET_STATUSES = frozenset({0, USAGE_EXIT_CODE, 75, 128 + signal.SIGINT, 128 + signal.SIGTERM})


#: Set by the launcher for its ranks when its own stderr is a terminal: the terminal's width in columns. A
#: rank's stderr is a pipe to the MPI launcher, so without it no rank could know a person is watching.
TERMINAL_VARIABLE = "CROSSBOW_TERMINAL_COLUMNS"


def terminal_env() -> dict[str, str]:
    """``{TERMINAL_VARIABLE: columns}`` when this process's stderr is a terminal, else nothing."""
    if not sys.stderr.isatty():
        return {}
    return {TERMINAL_VARIABLE: str(shutil.get_terminal_size().columns)}


def no_pmi_advice(tasks: int) -> str:
    """The one line for a ``srun`` step of ``tasks`` tasks without PMI: which ``--mpi`` this MPI needs."""
    use = {"mpich": "--mpi=pmi2 (this MPI is MPICH)", "openmpi": "--mpi=pmix (this MPI is Open MPI)"}
    return (
        f"srun started {tasks} tasks without a PMI plug-in, so each would run alone: run srun "
        f"{use.get(installed_flavor(), '--mpi=pmi2 (MPICH) or --mpi=pmix (Open MPI)')}; "
        "'srun --mpi=list' shows what this Slurm offers"
    )
