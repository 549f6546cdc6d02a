"""The jobs behind ``rule.init(...)`` / ``rule.wait()`` (Theano-MPI's facade, :mod:`.facade`).

Inside an MPI job (``mpiexec -n 2 python train.py``) ``init`` joins the running world: it prepares this rank's
session, agreeing on bad input like ``crossbow-launch`` does, and ``wait`` trains and returns the
:class:`~mpicrossbow.training.reporting.result.RunResult`. From a plain Python process ``init`` writes the
resolved cfg into the output folder and starts ``crossbow-launch`` under MPI with one rank per device;
``wait`` blocks until it ends and raises :class:`JobFailed` with its exit status if it failed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import TOP, Config, load_config
from ..errors import STOPPED_EXIT_CODE, UsageError
from ..launch.failure import ERROR_PREFIX, abort
from ..launch.world import detect_launcher
from ..rules.base import Rule
from ..rules.registry import RULES
from ..training.reporting.result import RunResult
from ..training.run.runner import prepare_session, train


class JobFailed(RuntimeError):
    """A job started by ``rule.init`` ended with a non-zero exit status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Job:
    """Something ``rule.wait()`` can wait for."""

    def wait(self) -> Any:
        """Block until the job ends."""
        raise NotImplementedError


class InWorldJob(Job):
    """This process is already a rank: the session is prepared and connected now, trained by ``wait``."""

    def __init__(self, config: Config, rule: Rule) -> None:
        self.world, self.session, code = prepare_session(config, rule)
        if code:
            raise UsageError("the session could not be prepared (see the error above)")
        try:
            self.session.prepare_collective()
        except BaseException as exc:
            abort(self.world, exc, self.session.run_dir)

    def wait(self) -> RunResult:
        """Train to the end; any exception aborts the whole job, as under crossbow-launch."""
        return train(self.world, self.session)


class SpawnedJob(Job):
    """A ``crossbow-launch`` MPI job started from this plain process.

    The job runs in its own session (process group), so stopping it reaches every process it started; its
    stderr is passed through line by line and the ``crossbow-launch: error:`` lines are kept for
    :class:`JobFailed`.
    """

    #: Seconds the job gets to end after SIGTERM before its whole process group is killed.
    STOP_GRACE_S = 5.0

    def __init__(self, config: Config) -> None:
        out = Path(config.session.output)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".cfg", prefix="rule-init-", dir=out, delete=False) as f:
            f.write(config.to_ini())
        self.cfg_path = Path(f.name)
        self.errors: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mpicrossbow.cli", "-cfg", str(self.cfg_path)],
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pass_stderr, daemon=True)
        self._reader.start()

    def _pass_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            sys.stderr.write(line)
            if line.startswith(ERROR_PREFIX):
                self.errors.append(line[len(ERROR_PREFIX) :].strip())
        sys.stderr.flush()

    def stop(self) -> None:
        """End the job: SIGTERM to the launcher (forwarded to mpiexec), then SIGKILL its process group."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left: mpiexec, proxies, ranks
        except ProcessLookupError:
            pass
        self.proc.wait()

    def wait(self) -> int:
        """Wait for the job; 0 on success, JobFailed naming the failing rank otherwise.

        Ctrl-C (KeyboardInterrupt) stops the whole job, then re-raises.
        """
        try:
            status = self.proc.wait()
            self._reader.join(timeout=10)
        except KeyboardInterrupt:
            self.stop()
            raise
        finally:
            self.cfg_path.unlink(missing_ok=True)
        if status:
            detail = "; ".join(dict.fromkeys(self.errors)) or (
                "stopped by a signal after a checkpoint, not finished (resume it with --resume)"
                if status == STOPPED_EXIT_CODE
                else "no error message (see the output above)"
            )
            raise JobFailed(status, f"crossbow-launch job failed with exit status {status}: {detail}")
        return 0


def start_job(
    rule: Rule,
    devices: list[str] | str,
    modelfile: str,
    modelclass: str,
    cfg: str | None,
    sections: Mapping[str, Mapping[str, Any]],
) -> Job:
    """Resolve the session for ``rule`` and start it in this world or as a new MPI job."""
    name = type(rule).name
    plain = vars(type(rule)).get("facade_of", type(rule))  # the built-in rule behind mpicrossbow.BSP & co.
    try:
        registered = RULES.get(name) is plain
    except UsageError:
        registered = False
    if not registered:
        name = f"{type(rule).__module__}:{type(rule).__qualname__}"
    top = {
        "rule": name,
        "modelfile": modelfile,
        "modelclass": modelclass,
        "devices": devices if isinstance(devices, str) else ",".join(devices),
    }
    extra = {TOP: top, **{k: dict(v) for k, v in sections.items()}, "rule": dataclasses.asdict(rule.hyper)}
    config = load_config(cfg, extra=extra)
    if detect_launcher() is not None:
        return InWorldJob(config, rule)
    return SpawnedJob(config)
