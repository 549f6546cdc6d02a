"""The failure protocol: no rank is ever left hanging.

* Bad input (cfg, CLI, model file, data file) is found before any rank communicates; :func:`agree` makes the
  ranks agree on it with one ``allgather``, rank 0 prints one line, every rank exits with status 2.
* Any exception later, on any rank, goes to :func:`abort`: one line naming the rank and the cause (the
  traceback goes to ``rank<r>.traceback`` in the run folder), then ``MPI_Abort``, which ends every rank.
  In elastic training (``[elastic] enabled``) it goes to :func:`leave_job` instead: the same line and file,
  then this rank alone ends by SIGKILL, which the survivors' ULFM sees, and they go on without it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ..errors import USAGE_EXIT_CODE, StorageError, UsageError
from .world import World

#: The variable naming a file where the first rank that aborts the job writes the job's exit status.
STATUS_FILE_VARIABLE = "CROSSBOW_STATUS_FILE"

#: The variable naming a file where rank 0 writes the run folder once training has finished and its results
#: are saved: the elastic template tells a runtime that fails after that point (Open MPI losing a daemon in
#: its teardown) from one that ended the job.
FINISHED_FILE_VARIABLE = "CROSSBOW_FINISHED_FILE"

#: How every failure line starts; ``rule.wait()`` collects these lines from a job it started.
ERROR_PREFIX = "crossbow-launch: error: "

#: Seconds between printing a rank's failure and MPI_Abort: MPI launchers forward output through pipes and
#: may drop what is still in flight when they kill the job.
ABORT_GRACE_S = 0.2

#: Seconds MPI_Abort may take before the rank ends itself: when a node or its link is gone, the abort request
#: can wait on a launcher that cannot reach that node (srun with PMI-2 held a rank 30 s on the namespace
#: cluster); the rank's own exit then lets the launcher end the others (srun --kill-on-bad-exit, mpiexec).
ABORT_DEADLINE_S = 5.0


def say(message: str, prefix: str = ERROR_PREFIX) -> None:
    """Write one failure line to stderr, in the form every tool around crossbow-launch recognises (the
    embedded API's lines start with its own ``prefix``)."""
    sys.stderr.write(f"{prefix}{message}\n")
    sys.stderr.flush()


def where(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame that raised ``exc``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "no traceback"
    last = frames[-1]
    return f"{Path(last.filename).name}:{last.lineno} in {last.name}"


def agree(world: World, prepare: Callable[[], object], prefix: str = ERROR_PREFIX) -> int:
    """Run ``prepare`` (no communication inside), then agree across ranks whether it worked.

    Returns 0 on success everywhere; otherwise rank 0 prints each distinct problem once and every rank
    returns 2 (bad input) or 1 (a crash).
    """
    problem: tuple[str, str] | None = None
    try:
        prepare()
    except UsageError as exc:
        problem = ("usage", str(exc))
    except Exception as exc:  # a crash while reading the user's files is still reported, not hung on
        problem = ("crash", f"{type(exc).__name__}: {exc} ({where(exc)})")
    problems = world.allgather(problem)
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not failed:
        return 0
    if world.rank == 0:
        seen: dict[str, list[int]] = {}
        for rank, (_, text) in failed:
            seen.setdefault(text, []).append(rank)
        for text, ranks in seen.items():
            everyone = len(ranks) == world.size
            say(text if everyone else f"rank {','.join(map(str, ranks))}: {text}", prefix)
    return USAGE_EXIT_CODE if all(kind == "usage" for _, (kind, _) in failed) else 1


def abort(world: World, exc: BaseException, run_dir: Path | None, prefix: str = ERROR_PREFIX) -> NoReturn:
    """Print one line naming this rank and the cause, keep the traceback in a file, abort every rank."""
    text, code, detail = _account(world, exc, run_dir)
    line = f"rank {world.rank} of {world.size} on {world.hostname} failed: {text}{detail}"
    abort_job(world, line, code, prefix=prefix)


def leave_job(world: World, exc: BaseException, run_dir: Path | None, prefix: str = ERROR_PREFIX) -> NoReturn:
    """Elastic training: this rank alone fails. One line naming it and the cause, the traceback in its file
    (as :func:`abort` writes them), then SIGKILL of this process — the one way of ending that ULFM reports
    to the survivors (an ``exit`` or a Python exception leaves them waiting), who drop it and go on."""
    text, _, detail = _account(world, exc, run_dir)
    say(
        f"rank {world.rank} of {world.size} on {world.hostname} failed and leaves the job: {text}{detail}",
        prefix,
    )
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")  # pragma: no cover


def _account(world: World, exc: BaseException, run_dir: Path | None) -> tuple[str, int, str]:
    """``(cause, exit status, where the traceback is)`` of a failure: the parts of its one line."""
    if isinstance(exc, KeyboardInterrupt):
        text, code = "interrupted", 130
    elif isinstance(exc, UsageError):
        text, code = str(exc), USAGE_EXIT_CODE
    elif isinstance(exc, StorageError):  # one line says it all (and the disk may not take a traceback)
        text, code = str(exc), 1
    elif exc.__traceback__ is None:  # reported, never raised (the watchdog's stall): the message says it all
        text, code = str(exc), 1
    else:
        text, code = f"{type(exc).__name__}: {exc} ({where(exc)})", 1
    detail = ""
    if (
        run_dir is not None
        and exc.__traceback__ is not None
        and not isinstance(exc, (KeyboardInterrupt, StorageError))
    ):
        detail = write_traceback(exc, run_dir / f"rank{world.rank}.traceback")
    return text, code, detail


def write_traceback(exc: BaseException, path: Path) -> str:
    """Write ``exc``'s traceback to ``path``, complete on disk before the job is torn down; what to add to
    the failure line (where it is, or why it could not be written — no empty file is left)."""
    try:
        with open(path, "w", encoding="utf-8") as file:
            file.write("".join(traceback.format_exception(exc)))
            file.flush()
            os.fsync(file.fileno())
    except OSError as err:
        path.unlink(missing_ok=True)
        return f"; traceback not written to {path}: {err.strerror or err}"
    return f"; traceback in {path}"


def abort_job(
    world: World, line: str, code: int = 1, record: bool = True, prefix: str = ERROR_PREFIX
) -> NoReturn:
    """Print ``line`` as the job's failure line and end every rank (``MPI_Abort``) with status ``code``.

    Safe from a second thread (the watchdog's): MPI_Abort needs no progress from the thread that is stuck.
    Launchers report the ranks they killed (srun: 137), not ``code``; with ``record`` the status is also
    written to the file ``$CROSSBOW_STATUS_FILE`` names (the sbatch templates set it and exit with it).
    """
    say(line, prefix)
    if record:
        record_status(code)
    if world.mpi is not None and world.size > 1:
        time.sleep(ABORT_GRACE_S)  # let the launcher forward the line before MPI_Abort tears the job down
        _exit_after(ABORT_DEADLINE_S, code)
        world.mpi.Abort(code)
    if threading.current_thread() is not threading.main_thread():
        sys.stderr.flush()
        os._exit(code)  # sys.exit would end only this thread (the watchdog's) and leave the rank running
    release_torch_groups(ABORT_DEADLINE_S, code)
    sys.exit(code)


def release_torch_groups(deadline_s: float, code: int) -> None:
    """Destroy torch.distributed's process groups before a rank exits on its own (no MPI_Abort: one rank).

    Why: a process that exits with an NCCL group alive does not end — NCCL's heartbeat monitor and the
    group's destructor run during interpreter finalization and waited there until the job was killed (seen
    on an H100: a one-rank job whose step raised stayed up 20 s after its failure line, until killed).
    Nothing is imported: without torch.distributed loaded there is nothing to release. Should the
    destruction itself hang, the process ends with ``code`` after ``deadline_s``.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    done = threading.Event()

    def _deadline() -> None:
        if not done.wait(deadline_s):
            sys.stderr.flush()
            os._exit(code)

    threading.Thread(target=_deadline, name="release-deadline", daemon=True).start()
    try:
        dist.destroy_process_group()
    except Exception:  # the job is failing already: its own cause is the one to report
        pass
    finally:
        done.set()


def _exit_after(seconds: float, code: int) -> None:
    """End this process with ``code`` in ``seconds`` unless it has ended by then (a daemon thread)."""

    def _exit() -> None:
        time.sleep(seconds)
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=_exit, name="abort-deadline", daemon=True).start()


def record_finished(run_dir: Path) -> None:
    """Write ``run_dir`` to ``$CROSSBOW_FINISHED_FILE`` if set: the run finished, its results are saved."""
    path = os.environ.get(FINISHED_FILE_VARIABLE)
    if not path:
        return
    try:
        Path(path).write_text(f"{run_dir}\n", encoding="utf-8")
    except OSError:
        pass  # the folder is gone: the launcher's status stands


def record_status(code: int) -> None:
    """Write ``code`` to ``$CROSSBOW_STATUS_FILE`` if set and not written yet (the first failure wins)."""
    path = os.environ.get(STATUS_FILE_VARIABLE)
    if not path:
        return
    try:
        with open(path, "x", encoding="ascii") as file:
            file.write(f"{code}\n")
    except OSError:
        pass  # written by another rank already, or the folder is gone: the launcher's status stands
