"""The showdown's grid (benchmarks/tta.cfg) and what its runs add up to: configurations, medians, winners.

A :class:`Task` is a model, a data set, a target accuracy and the optimizer family both sides train with; a
:class:`Setup` is one configuration of one side (DDP's global batch, or mpicrossbow's rule × learners ×
engine at one learning rate and, for SMA, one α; or ``learners = auto`` under one tuner) ; a run is a setup
at one seed. :func:`summarise` takes the runs of a task to one row per setup (medians over seeds) and
:func:`winners` picks each side's fastest to the target.

The learning rates are searched around each side's own rule: DDP and BSP, whose one optimizer step averages
a global batch B, at factors of the linear-scaling centre ``base_lr × B / base_batch``; the model-averaging
rules, whose every learner steps on its own batch of ``batch``, at η₀ × {1, √k, k} (``lr_scalings``) with
η₀ the task's single-learner rate ``learner_lr`` and k the learners in all, capped at ``learner_lr_cap``
(where one learner of that batch stops converging).

The showdown on one device (``[cuda]``, :class:`OneDevice`) is a separate, short plan: a handful of
configurations a side, each as a global batch and a factor of its linear-scaling centre, one process, plain
PyTorch (side :data:`TORCH`) against mpicrossbow's fused learners; the grid above is not changed by it.
"""

from __future__ import annotations

import configparser
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DDP, XB = "DDP", "mpicrossbow"
#: The one-device showdown's baseline: one replica in one process, a plain PyTorch loop (no DDP).
TORCH = "PyTorch"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


@dataclass(frozen=True)
class Task:
    """One task of the showdown (a ``[task NAME]`` section)."""

    name: str
    modelfile: str
    modelclass: str
    dataset: str
    target: float
    max_epochs: int
    momentum: float
    weight_decay: float
    warmup_epochs: float
    milestones: tuple[int, ...]
    gamma: float
    base_lr: float
    base_batch: int
    learner_lr: float
    learner_lr_cap: float

    def lr(self, factor: float, batch: int) -> float:
        """``factor`` × the linear-scaling centre for an optimizer step that averages ``batch`` samples."""
        return factor * self.base_lr * batch / self.base_batch

    def averaging_lr(self, scaling: str, k: int) -> float:
        """A model-averaging learner's rate for ``k`` learners in all: η₀ × 1, √k or k, capped."""
        return min(self.learner_lr * SCALINGS[scaling](k), self.learner_lr_cap)


#: ``lr_scalings`` → the factor on η₀ for k learners in all (as ``[optim] lr_scaling``).
SCALINGS = {"none": lambda k: 1.0, "sqrt": math.sqrt, "linear": float}
#: how a table names each scaling.
SCALING_NAMES = {"none": "η₀", "sqrt": "√k·η₀", "linear": "k·η₀"}


def alpha_value(form: str, k: int) -> float:
    """An α of the grid (a number, ``1/k`` or ``2/k``) for ``k`` learners in all."""
    form = form.replace(" ", "")
    if form.endswith("/k"):
        return float(form[:-2]) / k
    return float(form)


@dataclass(frozen=True)
class Setup:
    """One configuration at one learning rate: DDP (``global_batch``) or mpicrossbow (the rest)."""

    side: str
    lr: float
    global_batch: int = 0
    rule: str = ""
    learners: int = 0
    engine: str = ""
    batch: int = 0
    #: model-averaging rules: which of ``lr_scalings`` gave ``lr`` (empty: a factor of the linear centre)
    scaling: str = ""
    #: SMA: the grid's α as written (``0.1``, ``1/k``, ``2/k``); empty: the rule's default
    alpha: str = ""
    #: ``learners = auto``: the tuner (``goodput`` or ``throughput``); ``learners`` is then 0
    tune: str = ""

    @property
    def label(self) -> str:
        """How the tables name it."""
        if self.side == DDP:
            return f"DDP global batch {self.global_batch}, lr {self.lr:g}"
        if self.side == TORCH:
            return f"PyTorch one replica, batch {self.global_batch}, lr {self.lr:g}"
        if self.tune:
            return (
                f"{self.rule} learners auto ({self.tune}) x b{self.batch} {self.engine}, "
                f"lr {self.lr:g}·√k (lr_scaling sqrt)"
            )
        text = f"{self.rule} {self.learners} learner(s) x b{self.batch} {self.engine}, lr {self.lr:.3g}"
        if self.scaling:
            text += f" ({SCALING_NAMES[self.scaling]})"
        if self.alpha:
            text += f", α {self.alpha}"
        return text


@dataclass(frozen=True)
class Grid:
    """Everything in benchmarks/tta.cfg."""

    ranks: int
    threads: int
    seeds: tuple[int, ...]
    validate_every: float
    tasks: dict[str, Task]
    ddp_batches: tuple[int, ...]
    ddp_factors: tuple[float, ...]
    rules: tuple[str, ...]
    engines: tuple[str, ...]
    batch: int
    bsp_learners: tuple[int, ...]
    bsp_factors: tuple[float, ...]
    averaging_learners: tuple[int, ...]
    lr_scalings: tuple[str, ...]
    sma_alphas: tuple[str, ...]
    tuned_rule: str
    tuners: tuple[str, ...]
    max_learners: int
    #: ``[rule NAME]`` sections: settings every run of that rule takes (``[rule]`` keys)
    rule_settings: dict[str, dict[str, str]] = field(default_factory=dict)

    def setups(self, task: Task) -> list[Setup]:
        """Every configuration of both sides at each of its learning rates, DDP's first; no setup twice
        (a capped rate can make two scalings meet)."""
        out = [
            Setup(DDP, task.lr(f, batch), global_batch=batch)
            for batch in self.ddp_batches
            for f in self.ddp_factors
        ]
        for engine in self.engines:
            common = {"engine": engine, "batch": self.batch}
            if "BSP" in self.rules:
                out += [
                    Setup(XB, task.lr(f, self.ranks * m * self.batch), rule="BSP", learners=m, **common)
                    for m in self.bsp_learners
                    for f in self.bsp_factors
                ]
            for rule in (r for r in self.rules if r != "BSP"):
                for m in self.averaging_learners:
                    k = self.ranks * m
                    alphas = self.sma_alphas if rule == "SMA" else ("",)
                    out += [
                        Setup(
                            XB,
                            task.averaging_lr(scaling, k),
                            rule=rule,
                            learners=m,
                            scaling=scaling,
                            alpha=alpha,
                            **common,
                        )
                        for scaling in self.lr_scalings
                        for alpha in alphas
                    ]
            if self.tuned_rule in self.rules:
                out += [
                    Setup(XB, task.learner_lr, rule=self.tuned_rule, tune=tune, **common)
                    for tune in self.tuners
                ]
        return list(dict.fromkeys(out))


def _read(path: str | Path) -> configparser.ConfigParser:
    """The grid file, parsed (a missing file ends the program with its name)."""
    cfg = configparser.ConfigParser(inline_comment_prefixes=("#",))
    if not cfg.read(path, encoding="utf-8"):
        raise SystemExit(f"tta: no grid file {path}")
    return cfg


def _task(cfg: configparser.ConfigParser, name: str, path: str | Path) -> Task:
    """The ``[task NAME]`` section as a :class:`Task`."""
    if f"task {name}" not in cfg:
        raise SystemExit(f"tta: no [task {name}] in {path}")
    t = cfg[f"task {name}"]
    return Task(
        name=name,
        modelfile=t["modelfile"],
        modelclass=t["modelclass"],
        dataset=t["dataset"],
        target=t.getfloat("target"),
        max_epochs=t.getint("max_epochs"),
        momentum=t.getfloat("momentum"),
        weight_decay=t.getfloat("weight_decay"),
        warmup_epochs=t.getfloat("warmup_epochs"),
        milestones=tuple(_ints(t["milestones"])),
        gamma=t.getfloat("gamma"),
        base_lr=t.getfloat("base_lr"),
        base_batch=t.getint("base_batch"),
        learner_lr=t.getfloat("learner_lr"),
        learner_lr_cap=t.getfloat("learner_lr_cap"),
    )


def load_grid(path: str | Path, narrow: dict[str, str] | None = None) -> Grid:
    """Read the grid; ``narrow`` replaces lists by key (``seeds``, ``tasks``, ``global_batches``, ``rules``,
    ``learners`` (both BSP's and the averaging rules'), ``engines``, ``lr_scalings``, ``alphas``,
    ``tuners``): what a command line narrows or widens without editing the file."""
    cfg = configparser.ConfigParser(inline_comment_prefixes=("#",))
    if not cfg.read(path, encoding="utf-8"):
        raise SystemExit(f"tta: no grid file {path}")
    narrow = narrow or {}
    show, ddp, xb = cfg["showdown"], cfg["ddp"], cfg["mpicrossbow"]
    tasks = {name: _task(cfg, name, path) for name in _names(narrow.get("tasks") or show["tasks"])}
    return Grid(
        ranks=show.getint("ranks"),
        threads=show.getint("threads"),
        seeds=tuple(_ints(narrow.get("seeds") or show["seeds"])),
        validate_every=show.getfloat("validate_every"),
        tasks=tasks,
        ddp_batches=tuple(_ints(narrow.get("global_batches") or ddp["global_batches"])),
        ddp_factors=tuple(_floats(ddp["lr_factors"])),
        rules=tuple(_names(narrow.get("rules") or xb["rules"])),
        engines=tuple(_names(narrow.get("engines") or xb["engines"])),
        batch=xb.getint("batch"),
        bsp_learners=tuple(_ints(narrow.get("learners") or xb["bsp_learners"])),
        bsp_factors=tuple(_floats(xb["bsp_lr_factors"])),
        averaging_learners=tuple(_ints(narrow.get("learners") or xb["averaging_learners"])),
        lr_scalings=tuple(_checked(narrow.get("lr_scalings") or xb["lr_scalings"], SCALINGS)),
        sma_alphas=tuple(_names(narrow.get("alphas") or xb["sma_alphas"])),
        tuned_rule=xb["tuned_rule"],
        tuners=tuple(_names(narrow.get("tuners") or xb["tuners"])),
        max_learners=xb.getint("max_learners"),
        rule_settings={
            name.removeprefix("rule ").strip(): dict(cfg[name])
            for name in cfg.sections()
            if name.startswith("rule ")
        },
    )


def _checked(text: str, known: dict[str, Any]) -> list[str]:
    names = _names(text)
    for name in names:
        if name not in known:
            raise SystemExit(f"tta: lr_scalings: unknown {name!r} (use {', '.join(known)})")
    return names


@dataclass(frozen=True)
class OneDevice:
    """The showdown on one device (the ``[cuda]`` section): one process, a handful of configurations a side,
    every one on the task's schedule, epoch cap and validation cadence (``[showdown] validate_every``)."""

    task: Task
    seeds: tuple[int, ...]
    validate_every: float
    #: torch threads of the process (both sides; the work is the device's)
    threads: int
    #: mpicrossbow's rule (its rates follow the linear-scaling centre of the batch one step averages: BSP)
    rule: str
    #: mpicrossbow's ``[pool] engine``
    engine: str
    #: ``[pool] cuda_graphs`` on a CUDA device, where the framework has the key
    cuda_graphs: str
    #: mpicrossbow's Config overrides beyond the plan's, ``{section: {key: value}}`` (``[cuda] settings``)
    settings: dict[str, dict[str, str]]
    #: no run starts with fewer seconds than this left before the deadline (a run is at least this long)
    run_seconds: float
    #: every configuration in the order the runs go: the sides alternate, each side's likeliest winner first
    setups: tuple[Setup, ...]


def _at_pairs(text: str, key: str) -> list[tuple[str, float]]:
    """``A@F, B@F`` → ``[(A, F), …]`` (what ``[cuda] torch`` and ``mpicrossbow`` list)."""
    out = []
    for item in _names(text):
        size, sep, factor = item.partition("@")
        try:
            value = float(factor)
        except ValueError:
            value = math.nan
        if not sep or not size.strip() or not value > 0:
            raise SystemExit(f"tta: [cuda] {key}: {item!r} is not SIZE@FACTOR (e.g. 256@0.5)")
        out.append((size.strip(), value))
    return out


def _positive(text: str, key: str, item: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise SystemExit(f"tta: [cuda] {key}: {item!r} needs whole numbers of at least 1")
    return int(text)


def _overrides(text: str) -> dict[str, dict[str, str]]:
    """``section.key=value, …`` (crossbow-launch's override form) → ``{section: {key: value}}``."""
    out: dict[str, dict[str, str]] = {}
    for item in _names(text):
        dotted, sep, value = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot or not section or not key or not value.strip():
            raise SystemExit(f"tta: [cuda] settings: {item!r} is not SECTION.KEY=VALUE")
        out.setdefault(section, {})[key.strip()] = value.strip()
    return out


def load_one_device(path: str | Path, narrow: dict[str, str] | None = None) -> OneDevice:
    """Read the ``[cuda]`` section of the grid file: the one-device plan. ``torch`` lists ``BATCH@FACTOR``
    (one replica at that batch and FACTOR × the task's linear-scaling centre for it), ``mpicrossbow``
    ``LEARNERSxBATCH@FACTOR`` (fused learners at that batch, the rule's rate FACTOR × the centre for the
    ``LEARNERS × BATCH`` samples one step averages), ``settings`` mpicrossbow's further overrides as
    ``section.key=value``; ``narrow`` may replace ``seeds``."""
    cfg = _read(path)
    if "cuda" not in cfg:
        raise SystemExit(f"tta: no [cuda] section in {path}")
    one, show = cfg["cuda"], cfg["showdown"]
    task = _task(cfg, one["task"].strip(), path)
    engine, rule = one["engine"].strip(), one["rule"].strip()
    baseline = []
    for size, factor in _at_pairs(one["torch"], "torch"):
        batch = _positive(size, "torch", size)
        baseline.append(Setup(TORCH, task.lr(factor, batch), global_batch=batch))
    ours = []
    for size, factor in _at_pairs(one["mpicrossbow"], "mpicrossbow"):
        learners, sep, batch_text = size.lower().partition("x")
        if not sep:
            raise SystemExit(f"tta: [cuda] mpicrossbow: {size!r} is not LEARNERSxBATCH (e.g. 16x16)")
        m, b = _positive(learners, "mpicrossbow", size), _positive(batch_text, "mpicrossbow", size)
        ours.append(Setup(XB, task.lr(factor, m * b), rule=rule, learners=m, engine=engine, batch=b))
    order: list[Setup] = []
    for pair in itertools.zip_longest(baseline, ours):
        order += [s for s in pair if s is not None]
    return OneDevice(
        task=task,
        seeds=tuple(_ints((narrow or {}).get("seeds") or one["seeds"])),
        validate_every=show.getfloat("validate_every"),
        threads=one.getint("threads"),
        rule=rule,
        engine=engine,
        cuda_graphs=one["cuda_graphs"].strip(),
        settings=_overrides(one.get("settings", "")),
        run_seconds=one.getfloat("run_seconds"),
        setups=tuple(dict.fromkeys(order)),
    )


@dataclass
class Run:
    """What one run measured (training time leaves validation out; NaN where the target was not reached)."""

    setup: Setup
    seed: int
    seconds: float
    epochs: float
    samples_per_s: float
    final_accuracy: float
    curve: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def reached(self) -> bool:
        """The run reached the target."""
        return not math.isnan(self.seconds)

    def as_dict(self) -> dict[str, Any]:
        """For the JSON of all runs."""
        return {
            "setup": self.setup.__dict__,
            "seed": self.seed,
            "seconds": self.seconds,
            "epochs": self.epochs,
            "samples_per_s": self.samples_per_s,
            "final_accuracy": self.final_accuracy,
            "curve": self.curve,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Run:
        """Back from :meth:`as_dict` (runs saved before ``scaling``, ``alpha`` and ``tune`` load too)."""
        curve = [tuple(p) for p in d["curve"]]
        return Run(Setup(**d["setup"]), d["seed"], d["seconds"], d["epochs"], d["samples_per_s"],
                   d["final_accuracy"], curve)  # type: ignore[arg-type]  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One setup over its seeds: medians, with a run that missed the target counting as infinitely slow."""

    setup: Setup
    reached: int
    seeds: int
    seconds: float
    epochs: float
    samples_per_s: float
    final_accuracy: float
    median_run: Run


def _median_missing_last(values: Iterable[float]) -> float:
    """Median with NaN (target missed) ranked above every number; NaN when most missed."""
    ranked = sorted(values, key=lambda v: (math.isnan(v), v))
    mid = ranked[(len(ranked) - 1) // 2] if len(ranked) % 2 else None
    if mid is not None:
        return mid
    low, high = ranked[len(ranked) // 2 - 1], ranked[len(ranked) // 2]
    return math.nan if math.isnan(high) else (low + high) / 2


def summarise(runs: Sequence[Run]) -> list[Row]:
    """One row per setup, fastest median time to target first (setups that mostly missed it last)."""
    by_setup: dict[Setup, list[Run]] = {}
    for run in runs:
        by_setup.setdefault(run.setup, []).append(run)
    rows = []
    for setup, group in by_setup.items():
        seconds = _median_missing_last(r.seconds for r in group)
        ranked = sorted(group, key=lambda r: (math.isnan(r.seconds), r.seconds))
        rows.append(
            Row(
                setup=setup,
                reached=sum(r.reached for r in group),
                seeds=len(group),
                seconds=seconds,
                epochs=_median_missing_last(r.epochs for r in group),
                samples_per_s=statistics.median(r.samples_per_s for r in group),
                final_accuracy=statistics.median(r.final_accuracy for r in group),
                median_run=ranked[(len(ranked) - 1) // 2],
            )
        )
    return sorted(rows, key=lambda r: (math.isnan(r.seconds), r.seconds, r.setup.label))


def winners(rows: Sequence[Row]) -> dict[str, Row | None]:
    """Each side's fastest setup to the target (None: no setup of that side reached it on most seeds)."""
    best: dict[str, Row | None] = {DDP: None, XB: None}
    best.update((row.setup.side, None) for row in rows if row.setup.side not in best)
    for row in rows:
        if not math.isnan(row.seconds) and best[row.setup.side] is None:
            best[row.setup.side] = row
    return best
