"""Checkpointing as a component of the session: what a checkpoint holds, where ``resume`` looks, save and
restore. The file format (atomic per-rank files, ``meta.pt``, pruning) is :mod:`.checkpoint_files`'s."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ...config import Config
from ...errors import CheckpointError, ConfigError
from ...launch.slurm import SlurmJob
from ...launch.world import FollowsWorld, World, WorldView
from ...pool.base import LearnerPool
from ...rules.base import Rule
from ..health.faults import FaultInjector
from ..health.preemption import automatic_resume, written_by
from .checkpoint_files import (
    META,
    Checkpointer,
    complete_checkpoints,
    find_resume,
    load_rank_state,
    lost_ranks,
    safe_load,
    skipped_for,
)
from .checkpoint_lock import CheckpointLock
from .storage import check_room, check_writable, tensor_bytes

log = logging.getLogger(__name__)


class CheckpointManager(FollowsWorld):
    """This rank's checkpoints: the resume point read at set-up, and saves during training."""

    def __init__(
        self, config: Config, world: World | WorldView, pool: LearnerPool, device: torch.device
    ) -> None:
        self.follow(world)  # the run's shared view: elastic training moves it on
        self.config, self.pool, self.device = config, pool, device
        #: (checkpoint folder, its metadata, this rank's state) when resuming.
        self.resume: tuple[Path, dict[str, Any], dict[str, Any]] | None = None
        self.saver: Checkpointer | None = None
        #: Rank 0's ownership of the checkpoint folder, once taken.
        self.lock: CheckpointLock | None = None
        self.job = SlurmJob.from_env()
        #: Where a replacement goes on from (:meth:`adopt`), else None.
        self.adopted: dict[str, Any] | None = None
        #: The world size this run started with (an elastic run's checkpoints record it after a loss).
        self.start_size = self.world.size
        #: Resuming the checkpoint of a smaller world (:meth:`_grown_from`): this rank starts as a copy of
        #: rank 0's state.
        self.copied = False
        requeued = automatic_resume(config, self.job)
        if requeued and self._resume_requeued():
            return
        if config.checkpoint.resume:
            self._load(find_resume(config.checkpoint.resume, self.candidates(), self.looked()))
        elif requeued and self.world.rank == 0:
            assert self.job is not None
            log.info(
                "Slurm job %s restarted (restart %d): no checkpoint of its own in %s; starting from the "
                "beginning",
                self.job.job_id,
                self.job.restart_count,
                self.looked(),
            )

    def meta(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this job, and the world size the run started
        with (``start_size``: larger than ``world_size`` once elastic training lost ranks)."""
        return {
            "world_size": self.world.size,
            "rule": self.config.rule,
            "learners": len(self.pool.learners),
            "numel": int(self.pool.learners[0].params.numel()),
            "start_size": self.start_size,
        }

    def expected(self, grown_from: int | None = None) -> dict[str, Any]:
        """What a resumed checkpoint's :meth:`meta` must match: all of it but ``start_size``, the learner
        count under ``[pool] learners = auto``, where the checkpointed tuner's count rebuilds the pool
        (:meth:`tuner_state`), and ``world_size`` when resuming a smaller world (``grown_from``)."""
        meta = self.meta()
        del meta["start_size"]
        if self.config.pool.learners == "auto":
            del meta["learners"]
        if grown_from is not None:
            meta["world_size"] = grown_from
        return meta

    def _grown_from(self, path: Path) -> int | None:
        """The world size of checkpoint ``path`` when this job resumes it on more ranks, back to the size its
        run started with: a synchronous elastic run that lost ranks and saved on the survivors (a requeued
        Slurm job starts with its whole allocation again). Else None (sizes must then match)."""
        meta = safe_load(path / META, "its metadata file")
        size, start = meta.get("world_size"), meta.get("start_size")
        if isinstance(size, int) and size < self.world.size == start and not meta.get("lost"):
            return size
        return None

    def tuner_state(self) -> dict[str, Any]:
        """The auto-tuner's state in the resumed checkpoint (empty: none, or a fresh start)."""
        return dict(self.position.get("tuner", {}))

    def _pattern(self) -> str:
        cfg = self.config
        return cfg.session.name or f"{cfg.modelclass}-{cfg.rule.split(':')[-1]}-*"

    def candidates(self, job: SlurmJob | None = None) -> list[Path]:
        """Where ``resume = latest`` looks: the checkpoint directory, or this cfg's run folders (only those
        Slurm job ``job`` wrote, when given)."""
        cfg = self.config
        if cfg.checkpoint.directory:
            return [Path(cfg.checkpoint.directory)]
        runs = Path(cfg.session.output).glob(self._pattern())
        return sorted(
            p / "checkpoints"
            for p in runs
            if (p / "checkpoints").is_dir() and (job is None or written_by(p, job))
        )

    def looked(self) -> str:
        """Where ``resume = latest`` looks, in words, with absolute paths."""
        cfg = self.config
        if cfg.checkpoint.directory:
            return str(Path(cfg.checkpoint.directory).absolute())
        return f"{Path(cfg.session.output).absolute() / self._pattern() / 'checkpoints'}"

    def _resume_requeued(self) -> bool:
        """A requeued Slurm job: load the newest checkpoint of the run folder it wrote before; False when
        there is none."""
        assert self.job is not None
        candidates = self.candidates(self.job)
        named = self._named_run()  # where [checkpoint] resume started the job's first run, outside them
        if named is not None and named / "checkpoints" not in candidates and written_by(named, self.job):
            candidates.append(named / "checkpoints")
        try:
            path = find_resume("latest", candidates, self.looked())
        except CheckpointError:
            return False
        if self.world.rank == 0:
            log.info("Slurm job %s restarted (restart %d)", self.job.job_id, self.job.restart_count)
        self._load(path)
        return True

    def _named_run(self) -> Path | None:
        """The run folder ``[checkpoint] resume`` names (itself, or the one holding the checkpoint it names),
        else None."""
        spec = self.config.checkpoint.resume
        if not spec or spec == "latest":
            return None
        path = Path(spec)
        if (path / META).is_file() and path.parent.name == "checkpoints":
            return path.parent.parent
        return path if (path / "checkpoints").is_dir() else None

    def _load(self, path: Path) -> None:
        """Read this rank's part of the checkpoint ``path`` (no communication). Resuming a smaller world
        (:meth:`_grown_from`), the ranks it lacks read rank 0's file: every rank of a synchronous run is at
        the same step, so each new rank starts as a copy of rank 0 (its replicas, optimizer and rule
        state, the data position; its own data shard and random stream), as a replacement would."""
        grown_from = self._grown_from(path)
        self.copied = grown_from is not None and self.world.rank >= grown_from
        rank = 0 if self.copied else self.world.rank
        meta, state = load_rank_state(path, rank, self.expected(grown_from))
        self.resume = (path, meta, state)
        if self.world.rank == 0:
            self._say_resumed(path, int(meta["step"]), grown_from)

    def _say_resumed(self, path: Path, step: int, grown_from: int | None) -> None:
        """Rank 0's lines on what is resumed: the checkpoint, the ranks that start as copies of rank 0, the
        survivors-only checkpoints skipped for it."""
        log.info("resuming from %s (step %d)", path, step)
        if grown_from is not None:
            last = self.world.size - 1
            which = (
                f"rank {last} starts as a copy"
                if last == grown_from
                else f"ranks {grown_from}-{last} start as copies"
            )
            log.warning(
                "resuming a checkpoint of %d rank(s), the survivors of an elastic run that started with %d, "
                "on %d: %s of rank 0",
                grown_from,
                self.world.size,
                self.world.size,
                which,
            )
        skipped = skipped_for(path)
        if skipped:
            log.warning(
                "resuming from %s, the run's newest checkpoint with every rank's state: its %d later one(s) "
                "(the newest %s) were taken after elastic training lost rank(s) %s and hold the survivors' "
                "state only; the steps since are trained again",
                path.name,
                len(skipped),
                skipped[-1].name,
                ", ".join(str(r) for r in lost_ranks(skipped[-1])),
            )

    @property
    def position(self) -> dict[str, Any]:
        """Where training resumes: ``step``, ``epoch``, ``count`` (batches done in that epoch), ``lr``."""
        if self.adopted is not None:
            return self.adopted
        return self.resume[2]["position"] if self.resume is not None else {}

    def adopt(self, position: dict[str, Any]) -> None:
        """A replacement (``[elastic] replace``) goes on from the survivors' ``position``, not from a file:
        a checkpoint read at set-up is dropped."""
        self.resume, self.adopted = None, dict(position)

    @property
    def resume_step(self) -> int | None:
        """The step the resumed checkpoint was taken after, or None when starting fresh."""
        return None if self.resume is None else int(self.resume[1]["step"])

    def resumed_run_dir(self) -> Path | None:
        """Resuming from ``<run>/checkpoints/step-N``: continue in ``<run>`` (metrics are appended)."""
        if self.resume is None or self.config.checkpoint.directory:
            return None
        folder = self.resume[0].resolve().parent
        return folder.parent if folder.name == "checkpoints" else None

    def restore(self, rule: Rule) -> None:
        """Put this rank back where the checkpoint left it: replicas, optimizers, rule state, RNG."""
        if self.resume is None:
            return
        path, _, state = self.resume
        try:
            self.pool.load_state_dict(state["pool"])
            rule.load_state_dict(state["rule"])
            if self.copied:  # rank 0's state, not its random stream: this rank keeps its own seed's
                return
            torch.set_rng_state(state["rng"]["torch"])
            if self.device.type == "cuda" and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        except (KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None

    def target_directory(self) -> Path | None:
        """The checkpoint folder when known before the run folder exists: ``[checkpoint] directory``, or the
        ``checkpoints/`` of the run folder being resumed; None for a new run folder."""
        if self.config.checkpoint.directory:
            return Path(self.config.checkpoint.directory)
        run = self.resumed_run_dir()
        return run / "checkpoints" if run is not None else None

    def claim(self, saving: bool) -> None:
        """Before the ranks agree to train (no communication): the checkpoint folder is writable and has room
        for one checkpoint, and rank 0 holds its lock — a live job already using it, or old checkpoints a
        fresh run would mix with, are bad input here (exit 2), not a corruption later."""
        if not saving:
            return
        ckpt, directory = self.config.checkpoint, self.target_directory()
        if directory is not None:
            check_writable(directory, "[checkpoint] directory")
        if self.world.rank != 0:
            return
        if ckpt.enabled:  # every rank's state lands in one folder; optimizer state appears after a step
            needed = 2 * tensor_bytes(self.pool.state_dict()) * self.world.size
            check_room(directory or Path(self.config.session.output), needed, "[checkpoint] directory")
        if directory is not None:
            self._take(directory)

    def _take(self, directory: Path) -> None:
        """Rank 0: the lock of ``directory``; a fresh run clears old checkpoints only if told to."""
        self.lock = CheckpointLock(directory)
        self.lock.acquire()
        if self.resume is not None:
            return
        old = [*complete_checkpoints(directory), *directory.glob("step-*.partial")]
        if old and not self.config.checkpoint.overwrite:
            self.lock.release()
            raise ConfigError(
                f"[checkpoint] directory {directory} already holds checkpoints ({old[-1].name}, ...) and "
                "this run does not resume: resume from them (checkpoint.resume=latest) or set [checkpoint] "
                "overwrite = true to delete them"
            )
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        if old:
            log.warning(
                "[checkpoint] overwrite: deleted %d old checkpoint folder(s) in %s", len(old), directory
            )

    def start(self, run_dir: Path, mpi: Any = None) -> None:
        """Open the checkpoint folder (``[checkpoint] directory`` or ``<run>/checkpoints``) for saving; the
        saves' collectives go over ``mpi`` (default: the world's communicator; an elastic run's
        fault-tolerant group, which a loss revokes, so no survivor stays blocked in a save's barrier)."""
        ckpt = self.config.checkpoint
        directory = Path(ckpt.directory) if ckpt.directory else run_dir / "checkpoints"
        if self.world.rank == 0 and self.lock is None:  # a new run folder: nobody else can be there
            self._take(directory)
        mpi = self.world.mpi if mpi is None else mpi
        self.saver = Checkpointer(directory, self.world.rank, self.world.size, ckpt.keep, mpi)

    def take_over(self) -> bool:
        """Elastic training lost rank 0 and this rank is rank 0 now: the checkpoint folder's lock passes here
        (its holder is dead — ULFM says so, also where its host cannot be checked from this one). True when
        there was a folder to take."""
        if self.world.rank != 0 or self.lock is not None or self.saver is None:
            return False
        lock = CheckpointLock(self.saver.directory)
        lock.path.unlink(missing_ok=True)
        lock.acquire()
        self.lock = lock
        return True

    def close(self) -> None:
        """Give up the checkpoint folder (rank 0's lock)."""
        if self.lock is not None:
            self.lock.release()

    def save(
        self, position: dict[str, Any], rule: Rule, faults: FaultInjector, step: int | None = None
    ) -> Path:
        """Collective: every rank writes its state for the checkpoint after ``position['step']`` steps (an
        asynchronous snapshot: the agreed ``step`` names it, each rank's own position is in its file)."""
        assert self.saver is not None, "start() first"
        step = int(position["step"]) if step is None else step
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        state = {
            "rank": self.world.rank,
            "position": position,
            "pool": self.pool.state_dict(),
            "rule": rule.state_dict(),
            "rng": rng,
        }
        meta = {**self.meta(), "epoch": position["epoch"], "time": time.time()}
        return self.saver.save(step, state, meta, faults.in_save(step))
