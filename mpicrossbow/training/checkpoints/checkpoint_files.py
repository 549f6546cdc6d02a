"""Checkpoints: every rank's whole training state, written atomically, read back without unpickling code.

Layout, one folder per checkpoint::

    <directory>/step-000000120/           complete (renamed into place by rank 0 after every rank wrote)
        meta.pt                           version, step, epoch, world size, rule, learners, engine, model size
        rank-00000.pt ...                 each rank's state: replicas, optimizer, rule state, RNG, position
    <directory>/step-000000130.partial/   being written (or left by a crash): never loaded, removed later

Atomicity: each file is written to a temporary name, flushed, ``fsync``-ed and renamed; after a barrier rank 0
writes ``meta.pt`` the same way and renames the folder from ``.partial`` to its final name, then fsyncs the
parent. A crash at any moment leaves the previous complete checkpoint untouched, and a ``.partial`` folder is
never mistaken for a checkpoint. After the rename rank 0 deletes all but the newest ``keep`` checkpoints.

Reading uses ``torch.load(weights_only=True)``, which refuses anything but tensors and plain Python
containers, so a checkpoint cannot run code. Every problem — missing, truncated or corrupt files, another
format version, world size, rule or learner count — is a :class:`~mpicrossbow.errors.CheckpointError` with
one line naming the file.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, StorageError
from .storage import storage_error, tensor_bytes

log = logging.getLogger(__name__)

#: Bumped whenever the layout of a checkpoint changes incompatibly.
FORMAT_VERSION = 1
META = "meta.pt"
_STEP_DIR = re.compile(r"^step-(\d{9})$")
#: Seconds a rank waits for the rank that reports a refused checkpoint write to abort the job.
ABORT_WAIT_S = 30.0


def step_dir(directory: Path, step: int) -> Path:
    """The folder of the complete checkpoint taken after ``step`` steps."""
    return directory / f"step-{step:09d}"


def rank_file(path: Path, rank: int) -> Path:
    """The file that holds ``rank``'s state inside checkpoint folder ``path``."""
    return path / f"rank-{rank:05d}.pt"


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path, before_rename: Callable[[], None] | None = None) -> None:
    """``torch.save`` to a temporary file, fsync, rename onto ``path``: readers see the old or the new file.

    ``before_rename`` runs after the data is written and before it becomes visible (a fault-injection hook).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:  # a full disk shows as "unexpected pos" from torch's zip writer
        tmp.unlink(missing_ok=True)
        refused = storage_error(exc, path, tensor_bytes(obj) + 64 * 1024)
        if refused is not None:
            raise refused from None
        raise
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)


def safe_load(path: Path, what: str) -> dict[str, Any]:
    """Load a checkpoint file with ``weights_only=True``; any failure is one CheckpointError line."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path.parent}: {what} {path.name} is missing")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bit flips, foreign pickles: all unreadable
        reason = unreadable_reason(exc)
        raise CheckpointError(
            f"checkpoint file {path} is truncated or corrupt ({type(exc).__name__}: {reason})"
        ) from None
    if not isinstance(obj, dict) or obj.get("version") != FORMAT_VERSION:
        found = obj.get("version") if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(
            f"checkpoint file {path} has format version {found!r}; this mpicrossbow reads {FORMAT_VERSION}"
        )
    return obj


def unreadable_reason(exc: BaseException) -> str:
    """Why torch could not load a file, without torch's advice to retry with ``weights_only=False`` or to
    allow the file's classes (either would run whatever code the file carries)."""
    text = " ".join(str(exc).split())
    cause = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation| Please |$)", text)
    if cause:
        text = cause[1]
    sentences = [s for s in re.split(r"(?<=[.!?]) ", text) if "weights_only" not in s]
    return " ".join(sentences)[:160] or type(exc).__name__


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoint folders in ``directory``, oldest step first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _STEP_DIR.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: p.name)


def lost_ranks(path: Path) -> list[int]:
    """The start ranks elastic training had lost when checkpoint ``path`` was taken: empty when it holds
    every rank's state (or its metadata cannot be read: loading it then says what is wrong)."""
    try:
        meta = safe_load(path / META, "its metadata file")
    except CheckpointError:
        return []
    return [int(r) for r in meta.get("lost", ())]


def by_write_time(found: list[Path]) -> list[Path]:
    """Checkpoint folders ordered by when their ``meta.pt`` was written, oldest first: a run resumed from an
    earlier step writes over a timeline whose later steps are still on disk, and its new checkpoints are
    the newest though their step numbers are lower."""
    return sorted(found, key=lambda p: ((p / META).stat().st_mtime_ns, p.name))


def newest_whole(found: list[Path]) -> Path:
    """The newest written of ``found`` (not empty) that holds every rank's state; the newest of all when
    none does (loading it then refuses in one line). An elastic run that lost a worker goes on
    snapshotting the survivors: resuming the run restarts from its last snapshot before the loss."""
    ordered = by_write_time(found)
    for path in reversed(ordered):
        if not lost_ranks(path):
            return path
    return ordered[-1]


def skipped_for(path: Path) -> list[Path]:
    """The complete checkpoints beside ``path``, written after it, that name lost ranks: what resuming its
    run skipped (:func:`newest_whole`), oldest first, for the line that says so."""
    ordered = by_write_time(complete_checkpoints(path.parent))
    later = ordered[ordered.index(path) + 1 :] if path in ordered else []
    return [p for p in later if lost_ranks(p)]


def find_resume(spec: str, candidates: list[Path], looked: str = "") -> Path:
    """The checkpoint ``spec`` names: ``latest`` (newest in ``candidates``), a checkpoint or a run folder.
    A run folder or ``latest`` skips the checkpoints taken after elastic training lost a rank (they hold
    the survivors' state only) for the newest one with every rank's; a checkpoint folder named as such is
    taken as it is.

    ``looked`` describes where ``candidates`` came from, for the error when none holds a checkpoint."""
    if spec != "latest":
        path = Path(spec)
        if (path / META).is_file():
            return path
        inside = complete_checkpoints(path / "checkpoints") or complete_checkpoints(path)
        if inside:
            return newest_whole(inside)
        if not path.exists():
            raise CheckpointError(f"[checkpoint] resume: {path} does not exist")
        raise CheckpointError(f"[checkpoint] resume: {path} holds no complete checkpoint ({META} missing)")
    found = [c for directory in candidates for c in complete_checkpoints(directory)]
    if not found:
        where = ", ".join(str(c) for c in candidates) or "no such folder"
        raise CheckpointError(
            f"[checkpoint] resume = latest: no complete checkpoint; looked in {looked or where}"
            + (f" ({where})" if looked else "")
        )
    newest = by_write_time(found)[-1]
    return newest_whole(complete_checkpoints(newest.parent))


class Checkpointer:
    """Writes this rank's part of each checkpoint; rank 0 also publishes and prunes. Collective."""

    def __init__(
        self,
        directory: Path,
        rank: int,
        size: int,
        keep: int,
        mpi: Any = None,
        file_rank: int | None = None,
        lost: tuple[int, ...] = (),
    ) -> None:
        self.directory, self.rank, self.size, self.keep, self.mpi = directory, rank, size, keep, mpi
        #: The rank this rank's file is named after: its rank in ``mpi`` (default), or its start rank when
        #: ``mpi`` spans the survivors of an elastic run (their files keep their start ranks' names).
        self.file_rank = rank if file_rank is None else file_rank
        #: Start ranks an elastic run lost before this checkpoint: recorded in ``meta.pt`` (``lost``), so
        #: a resume refuses it in one line instead of failing on a missing file.
        self.lost = lost
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        self._barrier()

    def _barrier(self) -> None:
        if self.mpi is not None and self.size > 1:
            self.mpi.Barrier()

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        meta: Mapping[str, Any],
        before_rename: Callable[[], None] | None = None,
    ) -> Path:
        """Every rank writes ``state``; rank 0 writes ``meta`` and makes the checkpoint visible."""
        start = time.perf_counter()
        final = step_dir(self.directory, step)
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left over by a crash
            partial.mkdir(parents=True)
        self._barrier()
        try:
            atomic_save(
                {"version": FORMAT_VERSION, **state}, rank_file(partial, self.file_rank), before_rename
            )
            refused = None
        except StorageError as exc:
            refused = str(exc)
        self._agree_written(refused, partial)  # every rank's file is durable, or the job ends in one line
        if self.rank == 0:
            lost = {"lost": list(self.lost)} if self.lost else {}
            atomic_save({"version": FORMAT_VERSION, "step": step, **meta, **lost}, partial / META)
            _fsync_dir(partial)
            if final.exists():  # the same step saved again (a resumed run): replace it
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.directory)
            self._prune()
            log.info("checkpoint %s saved in %.2f s", final, time.perf_counter() - start)
        self._barrier()
        return final

    def _agree_written(self, refused: str | None, partial: Path) -> None:
        """Collective: when a disk refused any rank's file, rank 0 removes the half-written checkpoint, the
        lowest refused rank raises one StorageError for all (its abort ends the job), the others wait for
        that; the previous checkpoint stays as it was."""
        refusals = self.mpi.allgather(refused) if self.mpi is not None and self.size > 1 else [refused]
        failed = [rank for rank, text in enumerate(refusals) if text is not None]
        if not failed:
            return
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        self._barrier()
        if self.rank == failed[0]:
            others = f" (and on {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
            raise StorageError(f"{refusals[failed[0]]}{others}")
        time.sleep(ABORT_WAIT_S)  # rank failed[0] aborts the job meanwhile
        raise StorageError(f"rank {failed[0]} could not write its checkpoint file")

    def _prune(self) -> None:
        """Keep the ``keep`` newest written complete checkpoints; remove older ones and stale partial folders
        (safe: this job holds the directory's lock, so no other job is writing one). Newest written, not
        highest step: a run resumed from an earlier step drops the abandoned later ones first. Once elastic
        training lost a rank, the newest checkpoint with every rank's state is kept too: the later ones
        cannot be resumed, and without it a requeued job would have nothing to restart from."""
        complete = by_write_time(complete_checkpoints(self.directory))
        old = complete[: max(0, len(complete) - self.keep)]
        if self.lost and old:
            whole = newest_whole(complete)
            old = [p for p in old if p != whole]
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.directory.glob("step-*.partial"):
            shutil.rmtree(stale, ignore_errors=True)


def load_rank_state(
    path: Path, rank: int, expect: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, this rank's state) of checkpoint folder ``path``, checked against the job's ``expect``."""
    meta = safe_load(path / META, "its metadata file")
    if meta.get("lost"):
        lost = ", ".join(str(r) for r in meta["lost"])
        raise CheckpointError(
            f"checkpoint {path} was taken after elastic training lost rank(s) {lost}: it holds the "
            "survivors' state only, and a job cannot resume without every rank's; resume the run (--resume "
            "<its run folder> takes its newest checkpoint with every rank's) or start afresh"
        )
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} was written with {key} = {meta.get(key)!r}, this job has {value!r}; "
                f"resume with the same {key} or start afresh"
            )
    state = safe_load(rank_file(path, rank), f"rank {rank}'s file")
    if state.get("rank") != rank:
        raise CheckpointError(f"checkpoint file {rank_file(path, rank)} holds rank {state.get('rank')!r}")
    return meta, state
