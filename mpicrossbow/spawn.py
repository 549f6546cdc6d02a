"""Start an MPI job from a plain process: one rank per DEVICES entry, with the installed MPI's launcher.

This is what Theano-MPI's ``tmlauncher`` did: ``crossbow-launch -cfg session.cfg`` run without ``mpirun``
re-runs itself under ``mpiexec -n <len(DEVICES)>`` and returns the job's exit status. The launcher is the
one next to the running interpreter (the pip MPI wheel puts it there), else the first on PATH.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .devices import DeviceSpec, any_size
from .errors import UsageError

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


def spawn_command(mpiexec: str, flavor: str, devices: Sequence[DeviceSpec], args: Sequence[str]) -> list[str]:
    """The full launcher command: one rank per device, on the named hosts when DEVICES names hosts."""
    cmd = [mpiexec, "-n", str(len(devices))]
    hosts = [d.host for d in devices]
    if any(hosts):
        if not all(hosts):
            raise UsageError("DEVICES: give a host for every entry or for none (host:cuda0,cuda1 form)")
        counts = Counter(hosts)
        spec = ",".join(f"{h}:{counts[h]}" for h in dict.fromkeys(hosts))
        cmd += ["--host", spec] if flavor == "openmpi" else ["-hosts", spec]
    return [*cmd, sys.executable, "-m", "mpicrossbow.launcher", *args]


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


def expand_devices(devices: Sequence[DeviceSpec], ranks: int | None) -> list[DeviceSpec]:
    """One entry per rank to start: the list itself, or ``ranks`` (default: usable cores) for ``cpu``."""
    if any_size(tuple(devices)):
        return list(devices) * (ranks or len(os.sched_getaffinity(0)))
    if ranks is not None and ranks != len(devices):
        raise UsageError(f"-np {ranks} does not match DEVICES, which lists {len(devices)} device(s)")
    return list(devices)


def spawn(devices: Sequence[DeviceSpec], args: Sequence[str], ranks: int | None = None) -> int:
    """Start the job for ``devices`` running ``crossbow-launch args`` on every rank; return its status."""
    devices = expand_devices(devices, ranks)
    mpiexec = find_mpiexec()
    flavor = mpi_flavor(mpiexec)
    return run_job(spawn_command(mpiexec, flavor, devices, args), spawn_env(flavor, len(devices)))
