"""The job behind ``rule.init(...)`` / ``rule.wait()`` (Theano-MPI's facade).

Inside an MPI job (``mpiexec -n 2 python train.py``) ``init`` joins the running world: it builds this rank's
session, agreeing on bad input like ``crossbow-launch`` does, and ``wait`` trains and returns the
:class:`~mpicrossbow.session.RunResult`. From a plain Python process ``init`` writes the resolved cfg into
the output folder and starts ``crossbow-launch`` under MPI with one rank per device; ``wait`` blocks until
it ends and raises :class:`JobFailed` with its exit status if it failed.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import TOP, Config, load_config
from .env import detect_launcher, detect_world
from .errors import UsageError
from .log import setup_logging

if TYPE_CHECKING:
    from .rules.base import Rule
    from .session import RunResult, Session


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
    """This process is already a rank: the session is prepared now and trained by ``wait``."""

    def __init__(self, config: Config, rule: Rule) -> None:
        from .launcher import bind_and_prepare
        from .session import Session

        self.world = detect_world()
        setup_logging(self.world.rank, self.world.size)
        self.session: Session = Session(config, self.world, rule)
        if bind_and_prepare(self.world, self.session):
            raise UsageError("the session could not be prepared (see the error above)")
        self.session.prepare_collective()

    def wait(self) -> RunResult:
        """Train to the end; any exception aborts the whole job, as under crossbow-launch."""
        from .launcher import abort

        try:
            result = self.session.run()
            self.session.close()
        except BaseException as exc:
            abort(self.world, exc, self.session.run_dir)
        return result


class SpawnedJob(Job):
    """A ``crossbow-launch`` MPI job started from this plain process."""

    def __init__(self, config: Config) -> None:
        out = Path(config.session.output)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".cfg", prefix="rule-init-", dir=out, delete=False) as f:
            f.write(config.to_ini())
        self.cfg_path = Path(f.name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mpicrossbow.launcher", "-cfg", str(self.cfg_path)]
        )

    def wait(self) -> int:
        """Wait for the job; 0 on success, JobFailed otherwise (Ctrl-C stops the job and re-raises)."""
        try:
            status = self.proc.wait()
        except KeyboardInterrupt:
            self.proc.terminate()
            self.proc.wait()
            raise
        finally:
            self.cfg_path.unlink(missing_ok=True)
        if status:
            raise JobFailed(status, f"crossbow-launch job failed with exit status {status}")
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
    from .rules import RULES

    name = type(rule).name
    try:
        registered = RULES.get(name) is type(rule)
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
