"""A training session on one rank: build (device, model, pool, communicator, rule) from a Config, then loop.

Building is split in two so bad input can never hang a job: :meth:`Session.prepare_local` does everything
that needs no other rank (device, model file, data, replicas) and may fail with a one-line UsageError;
the launcher agrees on success across ranks before :meth:`Session.prepare_collective` starts talking
(communicator, initial broadcast, run folder). :meth:`Session.run` is the loop: epochs or steps, a
learning-rate schedule evaluated per step, the rule's hooks around each optimizer step, validation averaged
over ranks, metrics to HDF5 and a progress bar on rank 0.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..comm import make_communicator
from ..comm.base import Communicator, ReduceOp
from ..config import Config
from ..config.fields import call_kwargs
from ..errors import CheckpointError, ConfigError, ContractError
from ..launch.binding import Binding
from ..launch.devices import device_for_rank
from ..launch.world import World
from ..model.contract import contract_form, load_model_class
from ..model.shard import Shard
from ..pool import LearnerPool, TheanoPool
from ..pool.engines import ENGINES
from ..rules import RULES, Rule
from .autotune import AutoTuner
from .checkpoint import Checkpointer, find_resume, load_rank_state
from .faults import FaultInjector
from .metrics import MetricsWriter
from .schedule import lr_at
from .watchdog import Watchdog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    """What a finished session reports (identical on every rank)."""

    run_dir: str
    epochs: int
    steps: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    wall_seconds: float
    exchange_seconds: float
    samples_per_second: float


#: Steps after which a rank's resident memory is sampled as the warmed-up baseline (soak measurements).
RSS_WARM_STEPS = 1000

#: Steps between the ranks' agreements on whether a SIGTERM/SIGUSR1 arrived (the reaction time in steps).
SIGNAL_CHECK_STEPS = 10


def resident_mb() -> float:
    """This process's resident memory in MB (Linux /proc; NaN elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


class NonFiniteLoss(RuntimeError):
    """A learner's training loss became NaN or infinite and ``[session] on_nan = stop``."""


class Session:
    """One rank's part of a training job."""

    def __init__(self, config: Config, world: World, rule: Rule | None = None) -> None:
        self.config = config
        self.world = world
        self.rule = rule
        self.pool: LearnerPool | None = None
        self.comm: Communicator | None = None
        self.run_dir: Path | None = None
        self.metrics: MetricsWriter | None = None
        self.checkpointer: Checkpointer | None = None
        self.watchdog: Watchdog | None = None
        self.faults = FaultInjector(config.fault, world.rank)
        #: (checkpoint folder, its metadata, this rank's state) when resuming.
        self.resume: tuple[Path, dict[str, Any], dict[str, Any]] | None = None
        self._signal: int | None = None
        self._pending_signal: list[Any] = []
        self._rss_warm = math.nan
        #: Seconds of straggler sleep injected on this rank ([session] slow_*).
        self.injected_seconds = 0.0
        #: True when a SIGTERM/SIGUSR1 ended training early (after a checkpoint).
        self.stopped = False
        self.binding: Binding | None = None  # set by the launcher before prepare_local

    # ------------------------------------------------------------------ set-up
    def prepare_local(self) -> None:
        """Everything that involves no other rank: device, threads, seeds, model, data and replicas."""
        cfg, world = self.config, self.world
        spec = device_for_rank(cfg.devices, world.rank, world.size)
        self.device = spec.torch_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        threads = cfg.session.threads or (
            self.binding.threads
            if self.binding is not None
            else max(1, len(os.sched_getaffinity(0)) // max(1, world.local_size))
        )
        torch.set_num_threads(threads)
        if self.rule is None:
            self.rule = RULES.get(cfg.rule)(**cfg.rule_params)
        cls = load_model_class(cfg.modelfile, cfg.modelclass)
        form = contract_form(cls)
        # Same initial replicas everywhere (rank 0's are broadcast by bind() anyway).
        torch.manual_seed(cfg.session.seed)
        self.trains = self.rule.trains(world.rank, world.size)
        self.full_val: Any = None
        auto = cfg.pool.learners == "auto"
        learners = 1 if auto else int(cfg.pool.learners)
        self.tuner = AutoTuner(cfg.pool.tune_threshold, cfg.pool.max_learners) if auto else None
        if auto and not self.rule.synchronous:
            raise ConfigError(
                f"[pool] learners = auto needs a synchronous rule (every rank must change its learner count "
                f"at the same step); RULE={cfg.rule} is asynchronous: set [pool] learners to a number"
            )
        if form == "torch":
            model = _construct(cls, call_kwargs(cls, cfg.model_params, "model"))
            index, count = self.rule.train_shard(world.rank, world.size) if self.trains else (0, 1)
            span = self.rule.train_span(world.rank, world.size) if self.trains else None
            batch = cfg.data.batch_size
            engine = ENGINES.get(cfg.pool.engine)
            self.pool = engine(
                model,
                index,
                count,
                batch,
                cfg.optim,
                self.device,
                seed=cfg.session.seed,
                learners=learners,
                span=span,
            )
            if not self.rule.synchronous:  # ranks validate alone, on the whole validation set
                whole = count == 1 and learners == 1  # learner 0 already holds the whole set
                self.full_val = (
                    self.pool.datas[0] if whole else model.data(Shard(0, 1, batch, cfg.session.seed))
                )
        elif not self.rule.synchronous:
            raise ContractError(f"RULE={cfg.rule} is asynchronous and needs a torch-native model")
        elif auto or learners > 1 or cfg.pool.engine != "serial":
            raise ContractError(
                f"{cfg.modelclass} is a Theano-MPI-form model (it trains itself in train_iter): it runs one "
                "learner per rank; [pool] learners and engine need a torch-native model"
            )
        else:
            model = _construct(cls, {**self._theano_config(), **cfg.model_params}, positional=True)
            self.pool = TheanoPool(model)
        torch.manual_seed(cfg.session.seed * 1_000_003 + world.rank)  # per-rank dropout and augmentation
        if (cfg.checkpoint.enabled or cfg.checkpoint.resume) and not self.rule.synchronous:
            raise ConfigError(
                f"[checkpoint] every_steps/every_epochs/resume need a synchronous rule; RULE={cfg.rule} is "
                "asynchronous (ranks only meet at the end, so no step is common to all of them)"
            )
        if (cfg.checkpoint.enabled or cfg.checkpoint.resume) and auto:
            raise ConfigError(
                "[checkpoint] with [pool] learners = auto is not supported: set learners to the count the "
                "tuner chose (metrics.h5 attribute 'learners')"
            )
        if cfg.checkpoint.resume:
            self._load_resume()
        log.info(
            "%s model %s from %s on %s, %d thread(s), %s learner(s) per rank (%s engine), %d step(s)/epoch",
            form,
            cfg.modelclass,
            cfg.modelfile,
            self.device,
            threads,
            "auto: 1" if auto else learners,
            cfg.pool.engine,
            self.pool.n_batch_train,
        )

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this job."""
        assert self.pool is not None
        return {
            "world_size": self.world.size,
            "rule": self.config.rule,
            "learners": len(self.pool.learners),
            "numel": int(self.pool.learners[0].params.numel()),
        }

    def _resume_candidates(self) -> list[Path]:
        """Where ``resume = latest`` looks: the checkpoint directory, or this cfg's run folders."""
        cfg = self.config
        if cfg.checkpoint.directory:
            return [Path(cfg.checkpoint.directory)]
        output = Path(cfg.session.output)
        pattern = cfg.session.name or f"{cfg.modelclass}-{cfg.rule.split(':')[-1]}-*"
        return sorted(p / "checkpoints" for p in output.glob(pattern) if (p / "checkpoints").is_dir())

    def _load_resume(self) -> None:
        """Find and read this rank's part of the checkpoint to resume (no communication)."""
        path = find_resume(self.config.checkpoint.resume, self._resume_candidates())
        meta, state = load_rank_state(path, self.world.rank, self.checkpoint_meta())
        self.resume = (path, meta, state)
        if self.world.rank == 0:
            log.info("resuming from %s (step %d)", path, meta["step"])

    def check_consistency(self) -> None:
        """Collective: every rank built the same model (parameter shapes), or a ContractError on all ranks."""
        assert self.pool is not None
        mpi = self.world.mpi
        learner = self.pool.learners[0]
        mine = [tuple(p.shape) for p in getattr(learner, "param_list", [learner.params])]
        everyone = mpi.allgather(mine) if mpi is not None else [mine]
        for rank, shapes in enumerate(everyone):
            if shapes != everyone[0]:
                count = sum(math.prod(s) for s in shapes)
                first = sum(math.prod(s) for s in everyone[0])
                raise ContractError(
                    f"the model differs across ranks: rank 0 has {len(everyone[0])} parameter tensors "
                    f"({first:,} values), rank {rank} has {len(shapes)} ({count:,} values); "
                    "every rank must build the same network"
                )

    def _theano_config(self) -> dict[str, Any]:
        cfg, world = self.config, self.world
        return {
            "rank": world.rank,
            "size": world.size,
            "device": str(self.device),
            "verbose": world.rank == 0,
            "seed": cfg.session.seed,
            "batch_size": cfg.data.batch_size,
            "lr": cfg.optim.lr,
            "n_epochs": cfg.session.epochs,
        }

    def prepare_collective(self) -> None:
        """Communicator, rule binding (broadcast of rank 0's weights), run folder and metrics file."""
        assert self.pool is not None and self.rule is not None
        cfg, world = self.config, self.world
        mpi = world.mpi
        self.comm = make_communicator(
            cfg.comm.backend,
            self.device,
            mpi,
            compression=cfg.comm.compression,
            shared_memory=cfg.comm.shared_memory,
            window_bytes=int(cfg.comm.shm_window_mb * 2**20),
            min_bytes=int(cfg.comm.shm_min_kb * 2**10),
        )
        resume_step = None if self.resume is None else int(self.resume[1]["step"])
        if world.rank == 0:
            run_dir = self._resumed_run_dir() or self._make_run_dir()
        else:
            run_dir = None
        self.run_dir = Path(mpi.bcast(str(run_dir), root=0) if mpi is not None else str(run_dir))
        self.rule.bind(self.comm, self.pool)
        if self.resume is not None:
            self._restore(self.resume[2])
        # Asynchronous rules have no step that every rank reaches together: no checkpoints, no step watchdog.
        synchronous = self.rule.synchronous
        if synchronous and (cfg.checkpoint.enabled or cfg.checkpoint.on_signal):
            directory = (
                Path(cfg.checkpoint.directory) if cfg.checkpoint.directory else self.run_dir / "checkpoints"
            )
            self.checkpointer = Checkpointer(directory, world.rank, world.size, cfg.checkpoint.keep, mpi)
        if synchronous and (cfg.watchdog.warn_after or cfg.watchdog.abort_after):
            self.watchdog = Watchdog(
                self.run_dir / "heartbeats",
                world.rank,
                world.size,
                cfg.watchdog.warn_after,
                cfg.watchdog.abort_after,
                cfg.watchdog.interval,
                self._abort_stalled,
            ).start()
        processes = mpi.allgather(os.getpid()) if mpi is not None else [os.getpid()]
        if world.rank == 0:  # a launcher that reports a dead PID can be matched to its rank with this line
            log.info("rank processes: %s", ", ".join(f"{r}: pid {pid}" for r, pid in enumerate(processes)))
            text = cfg.to_ini()
            (self.run_dir / "session.cfg").write_text(text, encoding="utf-8")
            self.metrics = MetricsWriter(
                self.run_dir / "metrics.h5",
                text,
                {"world_size": world.size, "rule": cfg.rule},
                resume_step=resume_step,
            )
            log.info(
                "run folder %s; %d rank(s), rule %s, comm %s",
                self.run_dir,
                world.size,
                cfg.rule,
                self.comm.name,
            )

    def _resumed_run_dir(self) -> Path | None:
        """Resuming from ``<run>/checkpoints/step-N``: continue in ``<run>`` (metrics are appended)."""
        if self.resume is None or self.config.checkpoint.directory:
            return None
        folder = self.resume[0].resolve().parent
        return folder.parent if folder.name == "checkpoints" else None

    def _restore(self, state: dict[str, Any]) -> None:
        """Put this rank back where the checkpoint left it: replicas, optimizers, rule state, RNG."""
        assert self.pool is not None and self.rule is not None
        try:
            self.pool.load_state_dict(state["pool"])
            self.rule.load_state_dict(state["rule"])
            torch.set_rng_state(state["rng"]["torch"])
            if self.device.type == "cuda" and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        except (KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint {self.resume[0] if self.resume else ''}: {exc}") from None

    def _state(self, position: dict[str, Any]) -> dict[str, Any]:
        """This rank's checkpoint content."""
        assert self.pool is not None and self.rule is not None
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "rank": self.world.rank,
            "position": position,
            "pool": self.pool.state_dict(),
            "rule": self.rule.state_dict(),
            "rng": rng,
        }

    def _save(self, position: dict[str, Any]) -> Path:
        """Collective: every rank writes its state for the checkpoint after ``position['step']`` steps."""
        assert self.checkpointer is not None
        step = int(position["step"])
        meta = {**self.checkpoint_meta(), "epoch": position["epoch"], "time": time.time()}
        return self.checkpointer.save(step, self._state(position), meta, self.faults.in_save(step))

    def _abort_stalled(self, message: str) -> None:
        """The watchdog's abort: one line naming this rank, then MPI_Abort (from the watchdog thread)."""
        from ..cli import abort

        abort(self.world, RuntimeError(message), self.run_dir)

    def _make_run_dir(self) -> Path:
        cfg = self.config
        name = (
            cfg.session.name or f"{cfg.modelclass}-{cfg.rule.split(':')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        base = Path(cfg.session.output) / name
        path, n = base, 1
        while path.exists() and (path / "metrics.h5").exists():  # never overwrite an earlier run's results
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -------------------------------------------------------------------- loop
    def run(self) -> RunResult:
        """Train to the step or epoch budget (or serve); every rank returns the same RunResult."""
        assert self.pool is not None and self.rule is not None and self.comm is not None
        self._start = time.perf_counter()
        rss_start = resident_mb()
        if self.trains:
            try:
                epochs, steps, train, val, exchange_s, samples = self._train()
            finally:
                for handle in self._pending_signal:  # the last step's signal allreduce
                    handle.wait()
                self._pending_signal.clear()
                if self.checkpointer is not None and self.config.checkpoint.on_signal:
                    for sig in (signal.SIGTERM, signal.SIGUSR1):
                        signal.signal(sig, signal.SIG_DFL)
        else:
            self.rule.serve(self._report_served)
            epochs, steps, train, val, exchange_s, samples = 0, 0, (math.nan, math.nan), None, 0.0, 0.0
        busy = time.perf_counter() - self._start
        self.rule.finish()
        if self.trains and busy > 0:
            self._record_rank_rates(steps / busy, exchange_s / busy)
        else:
            self._record_rank_rates(math.nan, math.nan)
        self._record_rank_health(rss_start)
        if not self.rule.synchronous:  # everyone is here now: collectives are safe again
            samples = self.comm.allreduce_scalars([samples])[0]
            val = self._validate_async_final()
        assert val is not None
        wall = time.perf_counter() - self._start
        result = RunResult(
            run_dir=str(self.run_dir),
            epochs=epochs,
            steps=steps,
            train_loss=train[0],
            train_accuracy=train[1],
            val_loss=val[0],
            val_accuracy=val[1],
            wall_seconds=wall,
            exchange_seconds=exchange_s,
            samples_per_second=samples / wall if wall > 0 else 0.0,
        )
        if self.metrics is not None:
            self.metrics.close(
                learners=len(self.pool.learners),
                **{k: v for k, v in asdict(result).items() if k != "run_dir"},
            )
        return result

    def _train(self) -> tuple[int, int, tuple[float, float], tuple[float, float], float, float]:
        """The training loop of a rank that trains (from the resumed position, if any)."""
        assert self.pool is not None and self.rule is not None and self.comm is not None
        cfg, pool, rule, comm = self.config, self.pool, self.rule, self.comm
        ckpt = cfg.checkpoint
        budget = cfg.session.steps
        # With a step budget the epoch count follows from it; the auto-tuner may change steps per epoch.
        epochs = math.ceil(budget / pool.n_batch_train) if budget else cfg.session.epochs
        slowed = self.world.rank in cfg.session.slow_ranks
        delay = cfg.session.slow_seconds if slowed else 0.0
        stretch = cfg.session.slow_factor - 1.0 if slowed else 0.0
        position = self.resume[2]["position"] if self.resume is not None else {}
        epoch, step, skip = (
            int(position.get("epoch", 0)),
            int(position.get("step", 0)),
            int(position.get("count", 0)),
        )
        lr = float(position.get("lr", -1.0))
        bar = self._progress(budget or epochs * pool.n_batch_train, initial=step)
        exchange_s, samples, saved_at = 0.0, 0.0, step if self.resume is not None else -1
        train = val = (math.nan, math.nan)
        stop = self._watch_signals() if self.checkpointer is not None and ckpt.on_signal else None
        while epoch < epochs and (not budget or step < budget):
            per_epoch = pool.n_batch_train
            pool.start_epoch(epoch)
            pool.set_lr(lr_at(cfg.optim, epoch) if lr < 0 else lr, epoch)
            if skip:
                pool.skip(skip)
            epoch_start = time.perf_counter()
            for count in range(skip, min(per_epoch, skip + budget - step) if budget else per_epoch):
                step_start = time.perf_counter()
                if self.watchdog is not None:
                    self.watchdog.beat(step, "compute")
                self.faults.at_step(step)
                new_lr = lr_at(cfg.optim, epoch + count / per_epoch)
                if new_lr != lr:
                    if lr > 0:
                        rule.on_lr_change(lr, new_lr)
                    pool.set_lr(new_lr, epoch)
                    lr = new_lr
                pool.compute(count)
                self._check_finite(step, epoch)
                if self.watchdog is not None:
                    self.watchdog.beat(step, "exchange")
                t = time.perf_counter()
                rule.on_gradients(step)
                exchange_s += time.perf_counter() - t
                pool.apply()
                t = time.perf_counter()
                rule.exchange(step)
                exchange_s += time.perf_counter() - t
                step += 1
                if step == RSS_WARM_STEPS:
                    self._rss_warm = resident_mb()
                if delay or stretch:  # straggler injection: a fixed sleep, or (factor − 1) × this step
                    pause = delay + stretch * (time.perf_counter() - step_start)
                    time.sleep(pause)
                    self.injected_seconds += pause
                if bar is not None:
                    bar.update(1)
                here = {"step": step, "epoch": epoch, "count": count + 1, "lr": lr}
                if ckpt.every_steps and step % ckpt.every_steps == 0:
                    self._save(here)
                    saved_at = step
                if stop is not None and stop(step):
                    if saved_at != step:
                        self._save(here)
                    self._stopped_by_signal(step, bar)
                    return epoch, step, train, self._validate(), exchange_s, samples
            skip = 0
            epoch_seconds = time.perf_counter() - epoch_start
            learners = len(pool.learners)
            stats = pool.take_stats()
            if rule.synchronous:
                stats = tuple(comm.allreduce_scalars(list(stats)))
            loss_sum, hits, n = stats
            samples += n
            train = (loss_sum / max(n, 1), hits / max(n, 1))
            last = epoch == epochs - 1 or bool(budget and step >= budget)
            every = cfg.session.validate_every
            validated = last or bool(every and (epoch + 1) % every == 0)
            if validated:
                val = self._validate()
            wall = time.perf_counter() - self._start
            self._report(epoch, step, lr, learners, train, val if validated else None, wall, exchange_s, bar)
            if self.tuner is not None and not last:
                self._tune(n, epoch_seconds)
                if budget:
                    epochs = epoch + 1 + math.ceil((budget - step) / pool.n_batch_train)
                elif bar is not None:
                    bar.total = step + (epochs - epoch - 1) * pool.n_batch_train
            epoch += 1
            if ckpt.every_epochs and epoch % ckpt.every_epochs == 0 and saved_at != step and not last:
                self._save({"step": step, "epoch": epoch, "count": 0, "lr": lr})
                saved_at = step
        if ckpt.enabled and ckpt.final and saved_at != step:
            self._save({"step": step, "epoch": epoch, "count": 0, "lr": lr})
        if bar is not None:
            bar.close()
        return epoch, step, train, val, exchange_s, samples

    def _check_finite(self, step: int, epoch: int) -> None:
        """A NaN or infinite loss stops the job with a message, or (``on_nan = skip``) drops that batch."""
        assert self.pool is not None
        if not self.pool.has_gradients:  # Theano-MPI-form models report their own cost through the recorder
            return
        learners = self.pool.learners
        self.faults.poison(step, [lr.last_loss for lr in learners], [lr.grads for lr in learners])
        bad = self.pool.nonfinite()
        if not bad:
            return
        where = f"step {step} (epoch {epoch + 1}), learner(s) {', '.join(map(str, bad))}"
        if self.config.session.on_nan == "stop":
            raise NonFiniteLoss(
                f"training loss is NaN or infinite at {where}; lower [optim] lr, check the data, or set "
                "[session] on_nan = skip"
            )
        log.warning("loss is NaN or infinite at %s: that batch is skipped (its gradient zeroed)", where)
        for j in bad:
            learners[j].grads.zero_()

    def _watch_signals(self) -> Any:
        """SIGTERM/SIGUSR1 set a flag; returns ``stop(step)``, true on every rank once any rank was signalled.

        The ranks agree through one non-blocking 1-value allreduce every ``SIGNAL_CHECK_STEPS`` steps, started
        at one check and read at the next, so the decision is the same everywhere and nobody waits for it.
        """
        assert self.comm is not None

        def handler(signum: int, frame: Any) -> None:
            self._signal = signum

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)
        flag = torch.zeros(1, dtype=torch.float64)
        pending = self._pending_signal

        def stop(step: int) -> bool:
            assert self.comm is not None
            if step % SIGNAL_CHECK_STEPS:
                return False
            if pending:
                pending.pop().wait()
                if flag.item() > 0:
                    return True
            flag.fill_(1.0 if self._signal is not None else 0.0)
            pending.append(self.comm.allreduce(flag, ReduceOp.MAX, async_op=True))
            return False

        return stop

    def _stopped_by_signal(self, step: int, bar: Any) -> None:
        if bar is not None:
            bar.close()
        if self.world.rank == 0:
            log.warning(
                "stopped by a signal after step %d; checkpoint saved in %s: resume with --resume (or "
                "checkpoint.resume=latest)",
                step,
                self.checkpointer.directory if self.checkpointer else "?",
            )
        self.stopped = True

    def _tune(self, samples: float, seconds: float) -> None:
        """Auto-tuner check after an epoch: one allreduce of samples/s, then every rank resizes alike."""
        assert self.tuner is not None and self.pool is not None and self.rule is not None
        assert self.comm is not None
        # Samples are already summed over ranks; the slowest rank's time sets a synchronous job's pace.
        slowest = self.comm.allreduce_scalars([seconds], op=ReduceOp.MAX)[0]
        before = len(self.pool.learners)
        after = self.tuner.observe(samples / max(slowest, 1e-9))
        if after != before:
            self.pool.resize(after)
            self.rule.on_resize()
        if self.metrics is not None:
            self.metrics.file.attrs["autotune_history"] = [list(h) for h in self.tuner.history]

    def _record_rank_rates(self, rate: float, share: float) -> None:
        """Every rank's training steps/s and exchange share (NaN for serving ranks) into the metrics."""
        mpi = self.world.mpi
        pairs = mpi.allgather((rate, share)) if mpi is not None else [(rate, share)]
        if self.metrics is not None:
            self.metrics.file.attrs["rank_steps_per_second"] = [p[0] for p in pairs]
            self.metrics.file.attrs["rank_exchange_share"] = [p[1] for p in pairs]

    def _record_rank_health(self, rss_start: float) -> None:
        """Every rank's resident memory (start, after RSS_WARM_STEPS steps, end) and requests in flight."""
        assert self.rule is not None
        mine = (rss_start, self._rss_warm, resident_mb(), self.rule.in_flight, self.injected_seconds)
        mpi = self.world.mpi
        rows = mpi.allgather(mine) if mpi is not None else [mine]
        names = (
            "rank_rss_start_mb",
            "rank_rss_warm_mb",
            "rank_rss_end_mb",
            "rank_in_flight",
            "rank_slowed_s",
        )
        if self.metrics is not None:
            for i, name in enumerate(names):
                self.metrics.file.attrs[name] = [row[i] for row in rows]

    def _validate(self) -> tuple[float, float]:
        """Synchronous rules: every rank's shard, summed. Asynchronous: this rank alone, on the whole set."""
        assert self.pool is not None and self.rule is not None and self.comm is not None
        if not self.rule.synchronous:
            loss_sum, hits, n = self.pool.validate(self.rule.eval_params(), self.full_val)
            return loss_sum / max(n, 1), hits / max(n, 1)
        self.rule.sync_state()
        loss_sum, hits, n = self.comm.allreduce_scalars(list(self.pool.validate(self.rule.eval_params())))
        return loss_sum / max(n, 1), hits / max(n, 1)

    def _report_served(self, params: torch.Tensor, epoch: float) -> None:
        """Validation callback for a serving rank (rank 0 only logs and records)."""
        assert self.pool is not None
        if self.world.rank != 0:
            return
        loss_sum, hits, n = self.pool.validate(params, self.full_val)
        wall = time.perf_counter() - self._start
        val = (loss_sum / max(n, 1), hits / max(n, 1))
        if self.metrics is not None:
            self.metrics.val(epoch=epoch, step=0, loss=val[0], accuracy=val[1], time=wall, exchange_share=0.0)
        log.info("served model after %.2f epoch(s): val loss %.4f acc %.4f | %.1fs", epoch, *val, wall)

    def _validate_async_final(self) -> tuple[float, float]:
        """After ``finish``: rank 0 validates the rule's model; every rank's own model is reported too."""
        assert self.pool is not None and self.rule is not None and self.comm is not None
        mpi = self.world.mpi
        self.rule.sync_state()
        own = self.pool.validate(None, self.full_val) if self.trains else (math.nan, math.nan, 1.0)
        everyone = mpi.allgather(own[1] / max(own[2], 1)) if mpi is not None else [own[1] / max(own[2], 1)]
        val = None
        if self.world.rank == 0:
            loss_sum, hits, n = self.pool.validate(self.rule.eval_params(), self.full_val)
            val = (loss_sum / max(n, 1), hits / max(n, 1))
            log.info("final %s model: val loss %.4f acc %.4f", self.config.rule, *val)
            log.info("each rank's own model: %s", ", ".join(f"{a:.4f}" for a in everyone))
            wall = time.perf_counter() - self._start
            if self.metrics is not None:
                self.metrics.val(
                    epoch=math.nan, step=0, loss=val[0], accuracy=val[1], time=wall, exchange_share=0.0
                )
                self.metrics.file.attrs["rank_val_accuracy"] = everyone
        return mpi.bcast(val, root=0) if mpi is not None else val  # type: ignore[return-value]

    def _progress(self, total: int, initial: int = 0) -> Any:
        mode = self.config.session.progress
        if (
            self.world.rank != 0
            or mode == "off"
            or (mode == "auto" and not sys.stderr.isatty())
            or mode == "log"
        ):
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)

    def _report(
        self,
        epoch: int,
        step: int,
        lr: float,
        learners: int,
        train: tuple[float, float],
        val: tuple[float, float] | None,
        wall: float,
        exchange_s: float,
        bar: Any,
    ) -> None:
        if self.world.rank != 0:
            return
        share = exchange_s / wall if wall > 0 else 0.0
        text = f"epoch {epoch + 1} step {step}: train loss {train[0]:.4f} acc {train[1]:.4f}"
        if self.metrics is not None:
            self.metrics.train(
                step=step,
                epoch=epoch + 1,
                loss=train[0],
                accuracy=train[1],
                lr=lr,
                time=wall,
                learners=learners,
            )
        if val is not None:
            text += f" | val loss {val[0]:.4f} acc {val[1]:.4f}"
            if self.metrics is not None:
                self.metrics.val(
                    epoch=epoch + 1, step=step, loss=val[0], accuracy=val[1], time=wall, exchange_share=share
                )
        text += f" | lr {lr:.4g} | {wall:.1f}s, exchange {share:.0%}"
        if bar is not None:
            if val is not None:
                bar.set_postfix_str(f"val acc {val[1]:.4f}")
            bar.write(text)
        elif self.config.session.progress != "off":
            log.info(text)

    def close(self) -> None:
        """Stop the watchdog; close the metrics file, the pool and the communicator."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.pool is not None:
            self.pool.close()
        if self.comm is not None:
            self.comm.close()


def _construct(cls: type, kwargs: dict[str, Any], positional: bool = False) -> Any:
    """Instantiate the model class; a failure in the user's constructor becomes one ContractError line."""
    try:
        return cls(kwargs) if positional else cls(**kwargs)
    except TypeError as exc:
        raise ContractError(f"{cls.__name__}(...) could not be constructed: {exc}") from None
