"""A checkpoint directory has one owner: the job whose rank 0 holds its ``LOCK`` file.

Two jobs writing checkpoints into one folder corrupt each other (each removes the other's half-written
``.partial`` folders as stale, and the newer run's checkpoints replace the older's). So rank 0 creates
``<directory>/LOCK`` with ``O_EXCL`` before anything is written there, naming the job (Slurm job id), host,
pid, the pid's start time and kernel. A lock whose owner is provably gone — its pid on this kernel no longer
runs that process, or it was written by an earlier run of the same Slurm job (a requeue) — is taken over; a
live owner, or one on another host that cannot be checked, stops the new job before it trains with one line
naming the owner (and how to remove a lock left by a job that is gone). Two jobs taking the same stale lock
over at once end with one owner: the lock is moved aside before it is removed, and put back when it is no
longer the one read. The owner removes the lock when it closes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import CheckpointError
from ...launch.slurm import SlurmJob
from ..health.heartbeat import Beat, ended_here

LOCK = "LOCK"
#: Looks at a lock that exists but cannot be read yet, 0.1 s apart.
LOCK_TRIES = 50
#: An unreadable lock older than this was left by a crash between creating and writing it.
UNREADABLE_STALE_S = 5.0


@dataclass
class LockOwner:
    """Who holds a checkpoint directory."""

    host: str
    pid: int
    started: int
    boot: str
    pidns: str
    job: str
    since: float

    @classmethod
    def me(cls) -> LockOwner:
        """This process, in this (Slurm) job."""
        beat = Beat.mine(0, "")
        job = SlurmJob.from_env()
        return cls(
            beat.host, beat.pid, beat.started, beat.boot, beat.pidns, job.job_id if job else "", time.time()
        )

    def describe(self) -> str:
        """``job 123 on node7 (pid 4242) since 2026-11-23 10:00:00``."""
        job = f"job {self.job} " if self.job else "a job "
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{job}on {self.host} (pid {self.pid}) since {when}"

    def gone(self, me: LockOwner) -> bool:
        """Whether this owner has certainly stopped (False when it cannot be told from here)."""
        if self.job and self.job == me.job and (self.host, self.pid) != (me.host, me.pid):
            return True  # an earlier run of this same Slurm job (requeued): it ended before this one began
        return bool(ended_here(self.pid, self.started, self.boot, self.pidns))


class CheckpointLock:
    """Rank 0's ownership of one checkpoint directory for the life of a job."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK
        self.owner = LockOwner.me()
        self.held = False

    def acquire(self) -> None:
        """Take the directory, or a CheckpointError naming the job that holds it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"[checkpoint] directory {self.directory}: cannot create it: {exc.strerror or exc}"
            ) from None
        for _ in range(LOCK_TRIES):  # a lock taken over, released or being written: look again
            if self._create():
                self.held = True
                return
            holder, seen = self._read()
            if holder is None:
                time.sleep(0.1)
                continue
            if not holder.gone(self.owner):
                raise CheckpointError(
                    f"checkpoint directory {self.directory} is in use by {holder.describe()}: give this run "
                    f"its own [checkpoint] directory (if that job is gone, delete {self.path})"
                )
            self._remove(seen)  # its owner is gone: take it over
        raise CheckpointError(
            f"checkpoint directory {self.directory}: could not take its lock {self.path} (unreadable and "
            "recent: another job is starting there)"
        )

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            raise CheckpointError(
                f"[checkpoint] directory {self.directory}: cannot write there: {exc.strerror or exc}"
            ) from None
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(asdict(self.owner), file)
        return True

    def _read(self) -> tuple[LockOwner | None, bytes]:
        """The holder and the lock's bytes; no holder when the lock is gone or still being written (a crash
        right after creating it leaves it empty: once older than UNREADABLE_STALE_S it is removed)."""
        try:
            seen = self.path.read_bytes()
        except OSError:
            return None, b""
        try:
            return LockOwner(**json.loads(seen.decode("utf-8"))), seen
        except (ValueError, TypeError):
            try:
                if time.time() - self.path.stat().st_mtime > UNREADABLE_STALE_S:
                    self._remove(seen)
            except OSError:
                pass
            return None, seen

    def _remove(self, seen: bytes) -> None:
        """Remove the lock if it still holds ``seen`` (a gone owner's, or an unreadable stale one). Another
        job starting here may have taken the same lock over and written its own since it was read: removed
        by name, that live lock would go, and both jobs would write here. So the lock is moved aside first
        (of two jobs' renames one wins, the other finds nothing) and put back unless it is the one read."""
        aside = self.path.with_name(f"{LOCK}.{self.owner.host}.{self.owner.pid}.{time.monotonic_ns()}")
        try:
            os.rename(self.path, aside)
        except OSError:
            return  # moved by another job first, or gone: look again
        try:
            if aside.read_bytes() != seen:  # a live lock: back under its name, never over a newer one
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                except OSError:  # a file system without hard links: back by rename, unless one is there
                    if not self.path.exists():
                        os.rename(aside, self.path)
        except OSError:
            pass
        finally:
            aside.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if this process holds it (idempotent)."""
        if self.held:
            self.held = False
            holder, _ = self._read()
            if holder is not None and (holder.host, holder.pid) == (self.owner.host, self.owner.pid):
                self.path.unlink(missing_ok=True)
