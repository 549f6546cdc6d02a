"""Reporting: rank 0's console (a tqdm bar on a terminal, log lines otherwise) and ``metrics.h5``.

Nothing else writes the metrics file: the per-epoch train rows, the validation rows, the served model's
rows, and the per-rank attributes (steps/s, exchange share, start rank, resident memory, requests in flight,
injected straggler sleep, validation accuracy of each rank's own model, the auto-tuner's history), and the
world's changes of size under elastic training (``world_changes``: where a rank was lost or replaced).
Gathering a per-rank attribute is collective; every rank calls those methods.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...config import Config
from ...launch.slurm import SlurmJob
from ...launch.spawn import TERMINAL_VARIABLE
from ...launch.world import FollowsWorld, World, WorldView
from .metrics import MetricsWriter
from .result import RunResult
from .tensorboard_log import TensorBoardLog

log = logging.getLogger(__name__)

#: Steps after which a rank's resident memory is sampled as the warmed-up baseline (soak measurements).
RSS_WARM_STEPS = 1000


def resident_mb() -> float:
    """This process's resident memory in MB (Linux /proc; NaN elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def shown(value: float) -> str:
    """A measured figure as the log prints it; NaN (nothing measured: a serving rank, a model that reports
    no cost or error) as ``n/a``, never as a number."""
    return f"{value:.4f}" if math.isfinite(value) else "n/a"


def make_run_dir(config: Config) -> Path:
    """A new run folder ``<output>/<name>`` (``<name>-2``, ``-3``, ... when taken); never an existing one."""
    name = config.session.name or (
        f"{config.modelclass}-{config.rule.split(':')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    if config.link.groups > 1:  # each replica group's job writes a run folder of its own
        name += f"-group{config.link.group}"
    base = Path(config.session.output) / name
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base, 1
    while True:  # mkdir without exist_ok is atomic: two jobs starting together never share a folder
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


class Reporter(FollowsWorld):
    """Rank 0 writes; every rank takes part in gathering per-rank attributes."""

    def __init__(
        self,
        config: Config,
        world: World | WorldView,
        run_dir: Path,
        resume_step: int | None,
        start_rank: int | None = None,
    ) -> None:
        self.start = time.perf_counter()
        #: Steps done so far (:meth:`step_done`): where a change of the world is placed.
        self.steps_done = resume_step or 0
        #: ``(steps done, ranks before, ranks after, seconds of training)`` of every change of the world's
        #: size (elastic training: a loss, a replacement), kept on every rank (any may become rank 0).
        self.world_changes: list[tuple[int, int, int, float]] = []
        self.follow(world)  # the run's shared view: elastic training moves it on (the setter below)
        self.config, self.run_dir = config, run_dir
        world = self.world
        #: The rank this process had when the job started (a replacement: ``start_rank``, the rank it stands
        #: for).
        self.start_rank = world.rank if start_rank is None else start_rank
        self.rss_start, self.rss_warm = resident_mb(), math.nan
        self.metrics: MetricsWriter | None = None
        self.tensorboard: TensorBoardLog | None = None
        self._last_step = 0
        self.bar: Any = None
        self.samples_per_step = 1
        #: The rows of the latest epoch, ``(table, row)``, kept on every rank: a rank that becomes rank 0
        #: when elastic training loses it writes them where the lost rank 0 had not (:meth:`take_over`).
        self.last_rows: list[tuple[str, dict[str, float]]] = []
        processes = world.allgather(os.getpid())
        if world.rank != 0:
            return
        # A launcher that reports a dead PID can be matched to its rank with this line.
        log.info("rank processes: %s", ", ".join(f"{r}: pid {pid}" for r, pid in enumerate(processes)))
        text, attrs = self._header()
        (run_dir / "session.cfg").write_text(text, encoding="utf-8")
        self.metrics = MetricsWriter(run_dir / "metrics.h5", text, attrs, resume_step=resume_step)
        self.tensorboard = TensorBoardLog(run_dir, text) if config.session.tensorboard else None

    def _header(self) -> tuple[str, dict[str, Any]]:
        """The resolved cfg text (Slurm's job record as its header) and metrics.h5's file attributes."""
        job = SlurmJob.from_env()
        slurm = job.record() if job is not None else {}
        text = self.config.to_ini(header=[f"{k} = {v}" for k, v in slurm.items()])
        return text, {"world_size": self.world.size, "rule": self.config.rule, **slurm}

    def take_over(self, step: int) -> int:
        """Elastic training lost rank 0 and this rank is rank 0 now: the writing passes here. metrics.h5 is
        reopened for appending (what the lost rank 0 wrote up to ``step`` kept, a row it was killed in the
        middle of dropped), the latest epoch's rows written where the lost rank 0 died before writing them
        — so every epoch is there once — and TensorBoard's events go on in a new file of the same folder.
        Returns the train rows the file holds now."""
        if self.world.rank != 0 or self.metrics is not None:
            return 0
        text, attrs = self._header()
        del attrs["world_size"]  # the file keeps the size the job started with
        path = self.run_dir / "metrics.h5"
        self.metrics = MetricsWriter(path, text, attrs, resume_step=step, reopened_at="rank0_lost_at_step")
        if self.config.session.tensorboard:
            self.tensorboard = TensorBoardLog(self.run_dir, text)
        for table, row in self.last_rows:
            if float(row["step"]) not in self.metrics.steps(table):
                self._row(table, **row)
        return len(self.metrics.steps("train"))

    @property
    def world(self) -> World:
        """The run's world now, from the shared view: elastic training moves it on after a loss or a
        replacement (:mod:`~mpicrossbow.training.elastic.run_tolerance`)."""
        return self.view.now

    @world.setter
    def world(self, world: World) -> None:
        """Move the shared view on to ``world``, recording a change of its size in :attr:`world_changes`
        (so the report can mark a loss on its time axes, and the global batch can follow the world)."""
        before = self.view.now
        if before.size != world.size:
            self.world_changes.append((self.steps_done, before.size, world.size, self.wall))
        self.view.now = world

    @property
    def wall(self) -> float:
        """Seconds since training started."""
        return time.perf_counter() - self.start

    def restart_clock(self) -> None:
        """Training starts now (set-up time is not training time)."""
        self.start = time.perf_counter()
        self.rss_start = resident_mb()

    # ----------------------------------------------------------- progress
    def open_bar(self, total: int, initial: int = 0, samples_per_step: int = 1) -> None:
        """Rank 0's tqdm bar of ``total`` steps, when ``[session] progress`` asks for one (``auto``: when a
        person watches: this process's stderr is a terminal, or the launcher's was — under the launcher's
        own mpiexec a rank's stderr is a pipe, so the launcher says so in ``CROSSBOW_TERMINAL_COLUMNS``).

        It counts samples (``samples_per_step`` a step, over every rank), so the rate is samples/s; the
        postfix holds the epoch, the last training loss and validation accuracy."""
        mode = self.config.session.progress
        columns = os.environ.get(TERMINAL_VARIABLE, "")
        watched = sys.stderr.isatty() or columns.isdigit()
        if self.world.rank != 0 or mode in ("off", "log") or (mode == "auto" and not watched):
            return
        from tqdm import tqdm

        width = {"ncols": int(columns)} if columns.isdigit() and not sys.stderr.isatty() else {}
        self.samples_per_step = samples_per_step
        self.bar = tqdm(
            total=total * samples_per_step,
            initial=initial * samples_per_step,
            unit="sample",
            unit_scale=True,
            dynamic_ncols=not width,
            leave=True,
            **width,
        )

    def step_done(self, step: int) -> None:
        """One more step (``step`` steps done): advance the bar; sample resident memory once warmed up."""
        self.steps_done = step
        if step == RSS_WARM_STEPS:
            self.rss_warm = resident_mb()
        if self.bar is not None:
            self.bar.update(self.samples_per_step)

    def set_bar_total(self, steps_left: int, samples_per_step: int) -> None:
        """The auto-tuner changed the learners (so the samples of a step and the steps of an epoch): the
        bar's new total is what it counted so far and ``steps_left`` steps of ``samples_per_step``."""
        if self.bar is not None:
            self.samples_per_step = samples_per_step
            self.bar.total = self.bar.n + steps_left * samples_per_step

    def close_bar(self) -> None:
        """Close the bar (idempotent)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # --------------------------------------------------------------- rows
    def epoch(
        self,
        epoch: int,
        step: int,
        lr: float,
        learners: int,
        train: tuple[float, float],
        val: tuple[float, float] | None,
        times: tuple[float, float],
        noise_scale: float = math.nan,
    ) -> None:
        """Rank 0: the train row of ``epoch`` (0-based), the validation row if validated, one console line.

        ``times``: seconds spent in the exchange so far, and the share of this epoch's training time the
        learners waited for data (rank 0's); ``noise_scale``: the smoothed gradient noise scale B_noise in
        samples (:mod:`.noise_scale`; NaN where not measured). Every rank keeps them: :attr:`last_rows`."""
        exchange_s, data_wait = times
        wall = self.wall
        share = exchange_s / wall if wall > 0 else 0.0
        row = {"step": step, "epoch": epoch + 1, "loss": train[0], "accuracy": train[1], "lr": lr}
        extra = {"time": wall, "learners": learners, "data_wait": data_wait, "noise_scale": noise_scale}
        extra["world_size"] = self.world.size  # elastic training: the ranks training at the epoch's end
        rows: list[tuple[str, dict[str, float]]] = [("train", {**row, **extra})]
        if val is not None:
            val_row = {"epoch": epoch + 1, "step": step, "loss": val[0], "accuracy": val[1], "time": wall}
            rows.append(("val", {**val_row, "exchange_share": share}))
        self.last_rows = rows
        if self.world.rank != 0:
            return
        self._last_step = step
        for table, values in rows:
            self._row(table, **values)
        self._world_changes()
        text = f"epoch {epoch + 1} step {step}: train loss {shown(train[0])} acc {shown(train[1])}"
        if val is not None:
            text += f" | val loss {shown(val[0])} acc {shown(val[1])}"
        text += f" | lr {lr:.4g} | {wall:.1f}s, exchange {share:.0%}, data wait {data_wait:.0%}"
        if math.isfinite(noise_scale):
            text += f" | B_noise {noise_scale:.4g}"
        if self.bar is not None:
            postfix = f"epoch {epoch + 1} loss {shown(train[0])}"
            self.bar.set_postfix_str(postfix + (f" val acc {shown(val[1])}" if val is not None else ""))
            self.bar.write(text)
        elif self.config.session.progress != "off":
            log.info(text)

    def served(self, val: tuple[float, float], epoch: float) -> None:
        """Rank 0: the served model (a parameter server's) after ``epoch`` epochs of the workers."""
        wall = self.wall
        self._row("val", epoch=epoch, step=0, loss=val[0], accuracy=val[1], time=wall, exchange_share=0.0)
        log.info(
            "served model after %.2f epoch(s): val loss %s acc %s | %.1fs", epoch, *map(shown, val), wall
        )

    def final_model(self, val: tuple[float, float], every_rank: list[float]) -> None:
        """Rank 0, asynchronous rules: the rule's final model, and each rank's own model's accuracy."""
        log.info("final %s model: val loss %s acc %s", self.config.rule, *map(shown, val))
        log.info("each rank's own model: %s", ", ".join(map(shown, every_rank)))
        self._row(
            "val", epoch=math.nan, step=0, loss=val[0], accuracy=val[1], time=self.wall, exchange_share=0.0
        )
        if self.metrics is not None:
            self.metrics.file.attrs["rank_val_accuracy"] = every_rank

    def stopped_by_signal(self, step: int, directory: Path | None) -> None:
        """Rank 0 says where the checkpoint of a signalled stop is (what happens next: preemption)."""
        self.close_bar()
        if self.world.rank == 0:
            log.warning("stopped by a signal after step %d; checkpoint saved in %s", step, directory or "?")

    # --------------------------------------------------- per-rank attributes
    def autotune_history(self, history: Sequence[Sequence[float]]) -> None:
        """The auto-tuner's checks so far: (learners, samples/s, B_noise, efficiency, goodput) each."""
        if self.metrics is not None:
            self.metrics.file.attrs["autotune_history"] = [list(h) for h in history]

    def rank_rates(self, rate: float, share: float, trained: int = 0) -> None:
        """Collective: every rank's training steps/s and exchange share (NaN for serving ranks), the steps it
        trained (a resumed run's or a replacement's from where it started) and its start rank (after an
        elastic loss the survivors' ranks are renumbered; the report names them so)."""
        pairs = self.world.allgather((rate, share, self.start_rank, trained))
        figures = {"steps_per_second": [p[0] for p in pairs], "exchange_share": [p[1] for p in pairs]}
        if self.metrics is not None:
            for name, values in figures.items():
                self.metrics.file.attrs[f"rank_{name}"] = values
            self.metrics.file.attrs["rank_start_rank"] = [p[2] for p in pairs]
            self.metrics.file.attrs["rank_steps_trained"] = [p[3] for p in pairs]
        if self.tensorboard is not None:
            self.tensorboard.ranks(figures, self._last_step)

    def rank_health(self, in_flight: int, injected_seconds: float) -> None:
        """Collective: resident memory (start, warmed up, end), requests in flight, injected sleep."""
        mine = (self.rss_start, self.rss_warm, resident_mb(), in_flight, injected_seconds)
        rows = self.world.allgather(mine)
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

    def _world_changes(self) -> None:
        """Rank 0: :attr:`world_changes` as the attribute ``world_changes`` (rows of steps done, ranks
        before, ranks after, seconds), once there is one."""
        if self.metrics is not None and self.metrics.file.id.valid and self.world_changes:
            self.metrics.file.attrs["world_changes"] = [list(c) for c in self.world_changes]

    def _row(self, table: str, **row: float) -> None:
        """Rank 0: one row of ``train`` or ``val`` into metrics.h5 and, when on, the TensorBoard events."""
        if self.metrics is not None:
            getattr(self.metrics, table)(**row)
        if self.tensorboard is not None:
            self.tensorboard.row(table, row)

    def close(
        self,
        result: RunResult | None = None,
        learners: int | None = None,
        pool: Mapping[str, Any] | None = None,
    ) -> None:
        """Write the result's figures and ``pool`` (what the pool settled on: the fused engine's path and
        forms) as attributes and close the metrics and event files (idempotent)."""
        self.close_bar()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.metrics is None:
            return
        self._world_changes()
        attrs: dict[str, Any] = {}
        if result is not None:
            attrs = {k: v for k, v in dataclasses.asdict(result).items() if k not in ("run_dir", "curve")}
            attrs["learners"] = learners
        self.metrics.close(**attrs, **(pool or {}))
