"""A subprocess with a hard timeout that, when the timeout strikes, says where every process of it was.

``subprocess.run(..., timeout=T)`` kills only the child it started: an ``mpiexec`` goes, its ranks may
spin on, and the failure shows no more than the first bytes of the output. :func:`run_bounded` starts the
command in its own process group; on timeout it takes the Python stacks of every process in that group
(``py-spy dump``, from the ``test`` extra; it reads another process's memory, so it needs ptrace rights,
and says so when it lacks them), kills the whole group, and raises :class:`JobTimedOut` whose message
carries the ends of stdout and stderr and those stacks: a job that hung on a CI machine shows where.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: How much of each stream's end a timeout message shows.
TAIL_CHARS = 3000
#: Seconds one ``py-spy dump`` may take; the processes of a job are dumped one after the other.
DUMP_TIMEOUT_S = 20.0
#: Seconds a killed job's processes may take to finish exiting once their pipes closed.
GONE_TIMEOUT_S = 5.0
#: At most this many processes are dumped (a job's ranks and launcher; bounded so a timeout stays quick).
MAX_DUMPS = 8


class JobTimedOut(subprocess.TimeoutExpired):
    """A :func:`run_bounded` command ran past its timeout: the message names the command and shows the ends
    of its output and every process's Python stacks (``stacks``) at that moment."""

    def __init__(self, cmd: Sequence[str], timeout: float, stdout: str, stderr: str, stacks: str) -> None:
        super().__init__(list(cmd), timeout, output=stdout, stderr=stderr)
        self.stacks = stacks

    def __str__(self) -> str:
        out, err = self.stdout or "", self.stderr or ""
        return (
            f"{' '.join(map(str, self.cmd))} timed out after {self.timeout:g} s\n"
            f"--- the end of its stdout:\n{out[-TAIL_CHARS:]}\n"
            f"--- the end of its stderr:\n{err[-TAIL_CHARS:]}\n"
            f"--- where its processes were:\n{self.stacks}"
        )


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``, oldest (lowest pid) first; zombies left out."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return sorted(members)


def py_spy() -> str | None:
    """The ``py-spy`` next to this interpreter or on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def stacks_of(pids: Sequence[int]) -> str:
    """``py-spy dump`` of each process that runs Python (the others, e.g. mpiexec, by their command line)."""
    tool = py_spy()
    parts = []
    for pid in pids[:MAX_DUMPS]:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "python" not in command:
            parts.append(f"pid {pid}: {command.strip()} (not Python)")
        elif tool is None:
            parts.append(f"pid {pid}: {command.strip()} (no py-spy here: pip install py-spy)")
        else:
            try:
                done = subprocess.run(
                    [tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=DUMP_TIMEOUT_S
                )
                parts.append(done.stdout.strip() or f"pid {pid}: py-spy: {done.stderr.strip()[-500:]}")
            except subprocess.TimeoutExpired:
                parts.append(f"pid {pid}: {command.strip()} (py-spy took over {DUMP_TIMEOUT_S:g} s)")
    if len(pids) > MAX_DUMPS:
        parts.append(f"... and {len(pids) - MAX_DUMPS} more process(es)")
    return "\n\n".join(parts) or "(no process of the job was left)"


def run_bounded(
    args: Sequence[str], timeout: float, cwd: Path | str, env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` to completion, output captured as text; past ``timeout`` seconds raise
    :class:`JobTimedOut` with every process's stacks, once the whole process group is gone."""
    proc = subprocess.Popen(
        list(args),
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = stacks_of(group_members(proc.pid))
        stdout, stderr = ended(proc)
        raise JobTimedOut(args, timeout, stdout, stderr, stacks) from None
    except BaseException:  # an interrupted test session leaves no job behind either
        ended(proc)
        raise
    return subprocess.CompletedProcess(list(args), proc.returncode, stdout, stderr)


def ended(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill ``proc``'s process group and return what it wrote (a process that left the group and holds
    the pipes open is waited for at most :data:`DUMP_TIMEOUT_S`)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        out = proc.communicate(timeout=DUMP_TIMEOUT_S)
        # a killed process closes its pipes before it has finished exiting: wait until none is left
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return out
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        out, err = (
            x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr)
        )
        return out, err + "\n(its pipes stayed open: a process left the group)"
