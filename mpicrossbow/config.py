"""session.cfg: Theano-MPI's bare keys plus INI sections, read into one small dataclass per component.

A cfg looks like::

    RULE=BSP                  # bare keys before any section: Theano-MPI's form, unchanged
    MODELFILE=models.mlp
    MODELCLASS=MLP
    DEVICES=cpu0,cpu1

    [session]
    epochs = 20
    [optim]
    lr = 0.05
    [rule]                    # the rule's own hyper-parameters (BSP: mode = grad | avg)
    mode = grad
    [model]                   # keyword arguments of MODELCLASS
    hidden = 128

Command-line overrides use one syntax, ``section.key=value`` (or ``KEY=value`` for a bare key), e.g.
``crossbow-launch -cfg session.cfg optim.lr=0.05 session.epochs=3 RULE=BSP``. Every mistake — unknown
section or key, wrong type, out-of-range value, missing required key — is a ConfigError naming the key.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .devices import DeviceSpec, parse_devices
from .errors import ConfigError
from .validate import build, setting

TOP = "__top__"


@dataclass(frozen=True)
class SessionSection:
    """``[session]``: length of the run, seeding, outputs and console output."""

    epochs: int = setting(10, "passes over each rank's training shard", ge=0)
    steps: int = setting(0, "stop after this many steps in total (0: run all epochs)", ge=0)
    seed: int = setting(0, "seed for initial weights (broadcast from rank 0) and per-rank shuffling")
    output: str = setting("runs", "folder that receives one sub-folder per run")
    name: str = setting("", "run folder name (default: <modelclass>-<rule>-<date>-<time>)")
    validate_every: int = setting(1, "validate every N epochs (0: only after the last)", ge=0)
    progress: Literal["auto", "bar", "log", "off"] = setting(
        "auto", "rank 0 console output: a tqdm bar on a terminal, log lines otherwise"
    )
    log_level: Literal["debug", "info", "warning"] = setting("info", "log level of rank 0 (others: warning)")
    threads: int = setting(
        0, "torch threads per rank (0: the cores this rank may use / ranks on the node)", ge=0
    )
    slow_ranks: tuple[int, ...] = setting((), "test/benchmark hook: ranks that sleep after every step", ge=0)
    slow_seconds: float = setting(0.0, "test/benchmark hook: seconds each step of slow_ranks sleeps", ge=0)
    slow_factor: float = setting(
        1.0,
        "straggler hook: slow_ranks take this many times as long per step (sleeping the difference)",
        ge=1,
    )
    on_nan: Literal["stop", "skip"] = setting(
        "stop", "a learner's loss is NaN or infinite: stop the job with a message, or skip that batch"
    )


@dataclass(frozen=True)
class OptimSection:
    """``[optim]``: the default SGD recipe and the learning-rate schedule (per step, with warm-up)."""

    lr: float = setting(0.1, "base learning rate", gt=0)
    momentum: float = setting(0.9, "SGD momentum", ge=0, lt=1)
    weight_decay: float = setting(0.0, "L2 weight decay", ge=0)
    nesterov: bool = setting(False, "Nesterov momentum")
    schedule: Literal["none", "step", "multistep"] = setting("none", "learning-rate schedule")
    step_epochs: int = setting(30, "step schedule: multiply by gamma every N epochs", ge=1)
    milestones: tuple[int, ...] = setting(
        (), "multistep schedule: epochs at which to multiply by gamma", ge=1
    )
    gamma: float = setting(0.1, "decay factor of step/multistep", gt=0, le=1)
    warmup_epochs: float = setting(0.0, "linear warm-up from lr/10 over this many epochs", ge=0)

    def __post_init__(self) -> None:
        if self.schedule == "multistep" and not self.milestones:
            raise ValueError("schedule = multistep needs milestones, e.g. milestones = 30,60")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov = true needs momentum > 0")


@dataclass(frozen=True)
class DataSection:
    """``[data]``: batching of each rank's shard."""

    batch_size: int = setting(
        32, "samples per batch per learner (each of a rank's learners reads its own)", ge=1
    )


@dataclass(frozen=True)
class PoolSection:
    """``[pool]``: the learners one rank trains (Crossbow's learner pool) and the engine that runs them."""

    learners: int | Literal["auto"] = setting(
        1, "learners (model replicas) per rank, or auto: Crossbow's tuner picks the count", ge=1
    )
    engine: Literal["serial", "fused", "streams"] = setting(
        "serial",
        "serial: one learner after another; fused: the replicas as one wider model; "
        "streams: one CUDA stream per learner",
    )
    max_learners: int = setting(16, "learners = auto: the most learners per rank the tuner tries", ge=1)
    tune_threshold: float = setting(
        0.1, "learners = auto: add a learner while throughput rises by more than this fraction", ge=0
    )


@dataclass(frozen=True)
class CheckpointSection:
    """``[checkpoint]``: when to save every rank's full training state, how many to keep, how to resume."""

    every_steps: int = setting(0, "save every N steps (0: not by steps)", ge=0)
    every_epochs: int = setting(0, "save every N epochs (0: not by epochs)", ge=0)
    keep: int = setting(3, "keep the newest K checkpoints, delete older ones", ge=1)
    directory: str = setting("", "folder of the checkpoints (default: checkpoints/ in the run folder)")
    final: bool = setting(True, "with checkpoints on, also save after the last step")
    resume: str = setting(
        "", "resume from: latest (the newest complete checkpoint), a checkpoint or run folder; empty: start"
    )
    on_signal: bool = setting(
        True, "SIGTERM or SIGUSR1 (Slurm's warning before the time limit): save, then exit with status 0"
    )

    @property
    def enabled(self) -> bool:
        """Whether periodic checkpoints are on."""
        return bool(self.every_steps or self.every_epochs)


@dataclass(frozen=True)
class FaultSection:
    """``[fault]``: fault injection for tests and drills: make one rank fail at one step, on purpose."""

    rank: int = setting(-1, "the rank that fails (-1: none)", ge=-1)
    step: int = setting(0, "the step (0-based, counted over the whole run) at which it fails", ge=0)
    action: Literal["raise", "exit", "kill", "hang", "nan", "kill_in_save"] = setting(
        "raise",
        "raise an exception, exit(3), SIGKILL itself, hang, make its loss NaN, or SIGKILL itself "
        "in the middle of writing the checkpoint of that step",
    )


@dataclass(frozen=True)
class WatchdogSection:
    """``[watchdog]``: stall detection, as Horovod's stall check: name the ranks a stuck step waits for."""

    warn_after: float = setting(
        60.0, "seconds one step may take before the ranks behind are logged (0: off)", ge=0
    )
    abort_after: float = setting(0.0, "seconds after which a stalled job is aborted (0: never)", ge=0)
    interval: float = setting(1.0, "seconds between heartbeats and checks", gt=0)


@dataclass(frozen=True)
class CommSection:
    """``[comm]``: how ranks talk."""

    backend: Literal["auto", "mpi", "gloo", "nccl"] = setting(
        "auto", "auto: mpi4py on CPU devices, NCCL on CUDA devices"
    )
    compression: Literal["none", "fp16", "bf16"] = setting(
        "none", "exchange large float buffers as fp16 or bf16 (metrics, initial and final models stay exact)"
    )
    shared_memory: Literal["auto", "on", "off"] = setting(
        "auto",
        "float sum allreduce through node-shared memory (hierarchical across nodes); auto: on when the "
        "backend is mpi on CPU and some node runs more than one rank",
    )
    shm_window_mb: float = setting(
        16.0, "MB of each rank's input per shared-memory chunk (larger buffers go in chunks)", gt=0
    )
    shm_min_kb: float = setting(64.0, "allreduces smaller than this many KB go through MPI instead", ge=0)


@dataclass(frozen=True)
class NumaSection:
    """``[numa]``: which cores each rank runs on (see :mod:`mpicrossbow.numa`)."""

    bind: Literal["none", "core", "numa", "socket", "gpu"] = setting(
        "none", "core binding per rank: none, core, numa, socket, gpu (the cores local to the rank's GPU)"
    )
    memory: bool = setting(True, "prefer the NUMA node of a rank's cores for its memory (when it has one)")
    report: bool = setting(True, "rank 0 logs a table: rank, host, device, cores, NUMA node, threads")


#: Section name → dataclass, for the sections with fixed keys.
SECTIONS: dict[str, type] = {
    "session": SessionSection,
    "optim": OptimSection,
    "data": DataSection,
    "pool": PoolSection,
    "comm": CommSection,
    "numa": NumaSection,
    "checkpoint": CheckpointSection,
    "watchdog": WatchdogSection,
    "fault": FaultSection,
}
#: Sections whose keys belong to a plug-in (the rule's hyper-parameters, the model's keyword arguments).
FREE_SECTIONS = ("rule", "model")
#: The bare Theano-MPI keys; all required.
TOP_KEYS = ("rule", "modelfile", "modelclass", "devices")


@dataclass(frozen=True)
class Config:
    """A fully resolved session: what every rank builds its job from."""

    rule: str
    modelfile: str
    modelclass: str
    devices: tuple[DeviceSpec, ...]
    session: SessionSection = field(default_factory=SessionSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    pool: PoolSection = field(default_factory=PoolSection)
    comm: CommSection = field(default_factory=CommSection)
    numa: NumaSection = field(default_factory=NumaSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    watchdog: WatchdogSection = field(default_factory=WatchdogSection)
    fault: FaultSection = field(default_factory=FaultSection)
    rule_params: Mapping[str, Any] = field(default_factory=dict)
    model_params: Mapping[str, str] = field(default_factory=dict)
    source: str = "<python>"

    def replace(self, **changes: Any) -> Config:
        """A copy with some top-level fields changed."""
        return dataclasses.replace(self, **changes)

    def to_ini(self) -> str:
        """The resolved cfg text (defaults included); feeding it back to crossbow-launch repeats the run."""
        lines = [f"# resolved from {self.source}"]
        lines += [f"RULE={self.rule}", f"MODELFILE={self.modelfile}", f"MODELCLASS={self.modelclass}"]
        lines.append("DEVICES=" + ",".join(map(str, self.devices)))
        for name in SECTIONS:
            lines += ["", f"[{name}]"]
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                lines.append(f"{key} = {_format(value)}")
        for name, values in (("rule", self.rule_params), ("model", self.model_params)):
            if values:
                lines += ["", f"[{name}]"] + [f"{k} = {_format(v)}" for k, v in values.items()]
        return "\n".join(lines) + "\n"


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return "" if value is None else str(value)


def _read(path: Path | None, text: str | None) -> configparser.ConfigParser:
    if text is None:
        if path is None:
            raise ConfigError("no session.cfg given")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such cfg file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read cfg file: {exc}") from None
    parser = configparser.ConfigParser(interpolation=None, strict=True, inline_comment_prefixes=("#", ";"))
    try:
        parser.read_string(f"[{TOP}]\n{text}", source=str(path or "<text>"))
    except configparser.Error as exc:
        raise ConfigError(f"{path or 'cfg'}: {_parse_error(exc)}") from None
    return parser


def _parse_error(exc: configparser.Error) -> str:
    """configparser's complaint in cfg terms, with line numbers of the user's file (not of our header)."""
    if isinstance(exc, configparser.DuplicateOptionError):
        where = "the bare keys" if exc.section == TOP else f"[{exc.section}]"
        return f"line {(exc.lineno or 1) - 1}: key '{exc.option}' appears twice in {where}"
    if isinstance(exc, configparser.DuplicateSectionError):
        return f"line {(exc.lineno or 1) - 1}: section [{exc.section}] appears twice"
    if isinstance(exc, configparser.ParsingError) and exc.errors:
        lineno, line = exc.errors[0]
        line = line.strip()
        if line[:1] in "'\"":  # configparser stores repr(line)
            line = ast.literal_eval(line)
        return f"line {lineno - 1}: cannot parse {line.strip()!r}; expected key = value or [section]"
    return " ".join(str(exc).replace(TOP, "bare keys").split())


def _apply_override(raw: dict[str, dict[str, str]], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{item}': expected section.key=value or KEY=value")
    section, dot, name = key.strip().rpartition(".")
    raw.setdefault(section.lower() if dot else TOP, {})[name.strip().lower()] = value.strip()


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    text: str | None = None,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Read a cfg file (or ``text``), apply ``section.key=value`` overrides and ``extra`` values, validate.

    ``extra`` maps a section name (``"__top__"`` for bare keys) to typed values; rule.init() uses it.
    """
    path = Path(path) if path is not None else None
    raw: dict[str, dict[str, Any]] = {TOP: {}}
    if path is not None or text is not None:
        parser = _read(path, text)
        for section in parser.sections():
            raw[section.lower()] = dict(parser.items(section))
    for item in overrides:
        _apply_override(raw, item)
    for section, values in (extra or {}).items():
        raw.setdefault(section, {}).update({k.lower(): v for k, v in values.items()})
    return from_raw(raw, str(path) if path else "<python>")


def from_raw(raw: Mapping[str, Mapping[str, Any]], source: str) -> Config:
    """Validate a {section: {key: value}} mapping into a Config (``__top__`` holds the bare keys)."""
    valid_sections = [*SECTIONS, *FREE_SECTIONS]
    for section in raw:
        if section != TOP and section not in valid_sections:
            raise ConfigError(f"unknown section [{section}]; valid sections: {', '.join(valid_sections)}")
    top = dict(raw.get(TOP, {}))
    for key in top:
        if key not in TOP_KEYS:
            valid = ", ".join(k.upper() for k in TOP_KEYS)
            raise ConfigError(
                f"unknown key '{key.upper()}' before the first section; valid bare keys: {valid}"
            )
    for key in TOP_KEYS:
        if not str(top.get(key, "")).strip():
            raise ConfigError(f"missing required key {key.upper()} (a bare key before the first section)")
    devices = top["devices"]
    if isinstance(devices, (list, tuple)):
        devices = ",".join(map(str, devices))
    sections = {name: build(cls, raw.get(name, {}), name) for name, cls in SECTIONS.items()}
    rule_name, rule_params = _rule_params(str(top["rule"]).strip(), raw.get("rule", {}))
    return Config(
        rule=rule_name,
        modelfile=str(top["modelfile"]).strip(),
        modelclass=str(top["modelclass"]).strip(),
        devices=parse_devices(str(devices)),
        rule_params=rule_params,
        model_params=dict(raw.get("model", {})),
        source=source,
        **sections,
    )


def _rule_params(name: str, values: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Resolve RULE through the registry and validate ``[rule]`` against that rule's Config dataclass."""
    from .rules import RULES  # rules import torch; keep config importable cheaply until needed

    cls = RULES.get(name)
    hyper = build(cls.Config, values, "rule")
    canonical = name if ":" in name else name.upper()
    return canonical, dataclasses.asdict(hyper)
