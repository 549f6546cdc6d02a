"""Lost hosts: after a multi-node job that ``crossbow-launch`` started with mpiexec fails, which hosts no
longer answer.

When a whole node goes down, MPICH's hydra ends the job within a second and kills every rank with SIGKILL,
so no rank lives to say which node was lost: the user reads only hydra's ``assert (!closed) failed``.
``crossbow-launch`` run alone (:func:`~mpicrossbow.launch.spawn.spawn`) is still there when mpiexec ends: it
asks every host of the job, with the launcher's own remote command and a short timeout, whether it still
answers, and names the ones that do not in its failure line. The remote command is what the MPI used to
reach the hosts: hydra's ``HYDRA_LAUNCHER_EXEC`` or Open MPI's ``OMPI_MCA_plm_ssh_agent`` /
``OMPI_MCA_plm_rsh_agent`` when set, else ``ssh`` (batch mode: it never asks for a password). Under srun
there is nothing to do: Slurm names a lost node itself.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

#: Seconds a host has to answer.
ANSWER_TIMEOUT_S = 5.0
#: The variables that name the remote command an MPI launcher reaches hosts with, in the order looked at.
AGENT_VARIABLES = ("HYDRA_LAUNCHER_EXEC", "OMPI_MCA_plm_ssh_agent", "OMPI_MCA_plm_rsh_agent")


def reach_command(host: str, environ: Mapping[str, str]) -> list[str]:
    """The command that runs ``true`` on ``host`` the way the job's launcher reached it."""
    for variable in AGENT_VARIABLES:
        agent = environ.get(variable, "").strip()
        if agent:
            return [*shlex.split(agent), host, "true"]
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(ANSWER_TIMEOUT_S)}", host, "true"]


def lost_hosts(
    hosts: Sequence[str], environ: Mapping[str, str] | None = None, timeout: float = ANSWER_TIMEOUT_S
) -> list[str]:
    """The hosts among ``hosts`` that do not answer :func:`reach_command` within ``timeout`` seconds (all
    asked at once)."""
    environ = os.environ if environ is None else environ
    asked: dict[str, subprocess.Popen[bytes]] = {}
    for host in dict.fromkeys(hosts):
        try:
            asked[host] = subprocess.Popen(
                reach_command(host, environ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:  # no ssh at all: nothing can be said of any host
            log.debug("cannot ask %s whether it answers: %s", host, exc)
            return []
    deadline = time.monotonic() + timeout
    lost = []
    for host, proc in asked.items():
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the agent and whatever it started
            proc.wait()
            code = None
        if code != 0:
            lost.append(host)
    return lost


def lost_line(status: int, lost: Sequence[str]) -> str:
    """The failure line when hosts of a failed job no longer answer."""
    which = ", ".join(lost)
    return (
        f"the job ended with status {status} and {which} no longer answer{'s' if len(lost) == 1 else ''} "
        "(its processes, its node or its link are lost); resume from the last checkpoint with "
        "checkpoint.resume=<run folder> once it is back, or leave it out of the host list"
    )
