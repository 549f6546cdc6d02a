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
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .comm import make_communicator
from .comm.base import Communicator
from .config import Config
from .devices import device_for_rank
from .env import World
from .errors import ContractError
from .metrics import MetricsWriter
from .model import contract_form, load_model_class
from .numa import Binding
from .pool import LearnerPool, SerialPool, TheanoPool
from .rules import RULES, Rule
from .schedule import lr_at
from .shard import Shard
from .validate import call_kwargs

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
        if form == "torch":
            model = _construct(cls, call_kwargs(cls, cfg.model_params, "model"))
            index, count = self.rule.train_shard(world.rank, world.size) if self.trains else (0, 1)
            batch = cfg.data.batch_size
            self.pool = SerialPool(model, index, count, batch, cfg.optim, self.device, seed=cfg.session.seed)
            if not self.rule.synchronous:  # ranks validate alone, on the whole validation set
                self.full_val = (
                    self.pool.datas[0] if count == 1 else model.data(Shard(0, 1, batch, cfg.session.seed))
                )
        elif not self.rule.synchronous:
            raise ContractError(f"RULE={cfg.rule} is asynchronous and needs a torch-native model")
        else:
            model = _construct(cls, {**self._theano_config(), **cfg.model_params}, positional=True)
            self.pool = TheanoPool(model)
        torch.manual_seed(cfg.session.seed * 1_000_003 + world.rank)  # per-rank dropout and augmentation
        log.info(
            "%s model %s from %s on %s, %d thread(s), %d step(s) per epoch",
            form,
            cfg.modelclass,
            cfg.modelfile,
            self.device,
            threads,
            self.pool.n_batch_train,
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
        self.comm = make_communicator(cfg.comm.backend, self.device, mpi)
        run_dir = self._make_run_dir() if world.rank == 0 else None
        self.run_dir = Path(mpi.bcast(str(run_dir), root=0) if mpi is not None else str(run_dir))
        self.rule.bind(self.comm, self.pool)
        if world.rank == 0:
            text = cfg.to_ini()
            (self.run_dir / "session.cfg").write_text(text, encoding="utf-8")
            self.metrics = MetricsWriter(
                self.run_dir / "metrics.h5", text, {"world_size": world.size, "rule": cfg.rule}
            )
            log.info(
                "run folder %s; %d rank(s), rule %s, comm %s",
                self.run_dir,
                world.size,
                cfg.rule,
                self.comm.name,
            )

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
        if self.trains:
            epochs, steps, train, val, exchange_s, samples = self._train()
        else:
            self.rule.serve(self._report_served)
            epochs, steps, train, val, exchange_s, samples = 0, 0, (math.nan, math.nan), None, 0.0, 0.0
        busy = time.perf_counter() - self._start
        self.rule.finish()
        if self.trains and busy > 0:
            self._record_rank_rates(steps / busy, exchange_s / busy)
        else:
            self._record_rank_rates(math.nan, math.nan)
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
            self.metrics.close(**{k: v for k, v in asdict(result).items() if k != "run_dir"})
        return result

    def _train(self) -> tuple[int, int, tuple[float, float], tuple[float, float], float, float]:
        """The training loop of a rank that trains."""
        assert self.pool is not None and self.rule is not None and self.comm is not None
        cfg, pool, rule, comm = self.config, self.pool, self.rule, self.comm
        per_epoch = pool.n_batch_train
        total = cfg.session.steps or cfg.session.epochs * per_epoch
        epochs = math.ceil(total / per_epoch) if total else 0
        delay = cfg.session.slow_seconds if self.world.rank in cfg.session.slow_ranks else 0.0
        bar = self._progress(total)
        step, lr, exchange_s, samples = 0, -1.0, 0.0, 0.0
        train = val = (math.nan, math.nan)
        for epoch in range(epochs):
            pool.start_epoch(epoch)
            pool.set_lr(lr_at(cfg.optim, epoch), epoch)
            for count in range(min(per_epoch, total - step)):
                new_lr = lr_at(cfg.optim, epoch + count / per_epoch)
                if new_lr != lr:
                    if lr > 0:
                        rule.on_lr_change(lr, new_lr)
                    pool.set_lr(new_lr, epoch)
                    lr = new_lr
                pool.compute(count)
                t = time.perf_counter()
                rule.on_gradients(step)
                exchange_s += time.perf_counter() - t
                pool.apply()
                t = time.perf_counter()
                rule.exchange(step)
                exchange_s += time.perf_counter() - t
                step += 1
                if delay:
                    time.sleep(delay)
                if bar is not None:
                    bar.update(1)
            stats = pool.take_stats()
            if rule.synchronous:
                stats = tuple(comm.allreduce_scalars(list(stats)))
            loss_sum, hits, n = stats
            samples += n
            train = (loss_sum / max(n, 1), hits / max(n, 1))
            last = epoch == epochs - 1
            every = cfg.session.validate_every
            validated = last or bool(every and (epoch + 1) % every == 0)
            if validated:
                val = self._validate()
            wall = time.perf_counter() - self._start
            self._report(epoch, step, lr, train, val if validated else None, wall, exchange_s, bar)
        if bar is not None:
            bar.close()
        return epochs, step, train, val, exchange_s, samples

    def _record_rank_rates(self, rate: float, share: float) -> None:
        """Every rank's training steps/s and exchange share (NaN for serving ranks) into the metrics."""
        mpi = self.world.mpi
        pairs = mpi.allgather((rate, share)) if mpi is not None else [(rate, share)]
        if self.metrics is not None:
            self.metrics.file.attrs["rank_steps_per_second"] = [p[0] for p in pairs]
            self.metrics.file.attrs["rank_exchange_share"] = [p[1] for p in pairs]

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

    def _progress(self, total: int) -> Any:
        mode = self.config.session.progress
        if (
            self.world.rank != 0
            or mode == "off"
            or (mode == "auto" and not sys.stderr.isatty())
            or mode == "log"
        ):
            return None
        from tqdm import tqdm

        return tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)

    def _report(
        self,
        epoch: int,
        step: int,
        lr: float,
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
            self.metrics.train(step=step, epoch=epoch + 1, loss=train[0], accuracy=train[1], lr=lr, time=wall)
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
        """Close the metrics file, the pool and the communicator."""
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
