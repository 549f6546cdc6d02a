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
from typing import Any

from ..errors import ConfigError
from ..launch.devices import DeviceSpec, any_size, parse_devices
from . import sections as s
from .fields import build
from .theano_dialect import DIALECT_KEYS, normalise_text, size_of, translate

TOP = "__top__"

#: Section name → dataclass, for the sections with fixed keys.
SECTIONS: dict[str, type] = {
    "session": s.SessionSection,
    "optim": s.OptimSection,
    "data": s.DataSection,
    "pool": s.PoolSection,
    "comm": s.CommSection,
    "numa": s.NumaSection,
    "checkpoint": s.CheckpointSection,
    "watchdog": s.WatchdogSection,
    "elastic": s.ElasticSection,
    "link": s.LinkSection,
    "inject": s.InjectSection,
}
#: Sections whose keys belong to a plug-in (the rule's hyper-parameters, the model's keyword arguments).
FREE_SECTIONS = ("rule", "model", "dataset")
#: The bare Theano-MPI keys; all required.
TOP_KEYS = ("rule", "modelfile", "modelclass", "devices")
#: Sections that are gone, each key → (the section it moved to, its name there): ``[fault]`` mixed the
#: tolerance of elastic training with the drills that break a run on purpose, so it was split in two.
MOVED: dict[str, dict[str, tuple[str, str]]] = {
    "fault": {
        "elastic": ("elastic", "enabled"),
        "min_ranks": ("elastic", "min_ranks"),
        "commit_every": ("elastic", "commit_every"),
        "replace": ("elastic", "replace"),
        "rank": ("inject", "rank"),
        "step": ("inject", "step"),
        "action": ("inject", "action"),
    },
}


@dataclass(frozen=True)
class Config:
    """A fully resolved session: what every rank builds its job from."""

    rule: str
    modelfile: str
    modelclass: str
    devices: tuple[DeviceSpec, ...]
    #: Theano-MPI's SIZE: the job's number of ranks, checked when it starts (None: not given).
    size: int | None = None
    session: s.SessionSection = field(default_factory=s.SessionSection)
    optim: s.OptimSection = field(default_factory=s.OptimSection)
    data: s.DataSection = field(default_factory=s.DataSection)
    pool: s.PoolSection = field(default_factory=s.PoolSection)
    comm: s.CommSection = field(default_factory=s.CommSection)
    numa: s.NumaSection = field(default_factory=s.NumaSection)
    checkpoint: s.CheckpointSection = field(default_factory=s.CheckpointSection)
    watchdog: s.WatchdogSection = field(default_factory=s.WatchdogSection)
    elastic: s.ElasticSection = field(default_factory=s.ElasticSection)
    link: s.LinkSection = field(default_factory=s.LinkSection)
    inject: s.InjectSection = field(default_factory=s.InjectSection)
    #: ``[rule]`` as written (strings from a file); the rule validates them once, when it is built.
    rule_params: Mapping[str, Any] = field(default_factory=dict)
    model_params: Mapping[str, str] = field(default_factory=dict)
    #: ``[dataset]`` as written: keyword arguments of the ``[data] dataset`` factory.
    dataset_params: Mapping[str, str] = field(default_factory=dict)
    source: str = "<python>"

    def replace(self, **changes: Any) -> Config:
        """A copy with some top-level fields changed."""
        return dataclasses.replace(self, **changes)

    def to_ini(self, header: Sequence[str] = ()) -> str:
        """The resolved cfg text (defaults included); feeding it back to crossbow-launch repeats the run.

        ``header``: lines recorded as comments at the top (where and when the run ran)."""
        lines = [f"# resolved from {self.source}", *(f"# {line}" for line in header)]
        lines += [f"RULE={self.rule}", f"MODELFILE={self.modelfile}", f"MODELCLASS={self.modelclass}"]
        hosts = any(spec.host for spec in self.devices)  # host:entry groups are separated by spaces
        lines.append("DEVICES=" + (" " if hosts else ",").join(map(str, self.devices)))
        if self.size is not None:
            lines.append(f"SIZE={self.size}")
        for name in SECTIONS:
            lines += ["", f"[{name}]"]
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                lines.append(f"{key} = {format_value(value)}")
        free = (("rule", self.rule_params), ("model", self.model_params), ("dataset", self.dataset_params))
        for name, values in free:
            if values:
                lines += ["", f"[{name}]"] + [f"{k} = {format_value(v)}" for k, v in values.items()]
        return "\n".join(lines) + "\n"


def format_value(value: Any) -> str:
    """A value as a cfg file writes it: booleans lower-case, sequences comma-separated, None empty."""
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
        parser.read_string(f"[{TOP}]\n{normalise_text(text)}", source=str(path or "<text>"))
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


def moved(section: str, key: str | None, *, override: bool = False) -> str:
    """The one line refusing a key of a section that is gone (``key`` None: the section itself), naming
    where it lives now: ``[fault] elastic moved: use [elastic] enabled``, or in an override's own syntax
    ``fault.elastic moved: use elastic.enabled``."""
    keys = MOVED[section]
    name = key.strip().lower().replace("-", "_") if key is not None else None
    if name in keys:
        new_section, new_key = keys[name]
        if override:
            return f"{section}.{key} moved: use {new_section}.{new_key}"
        return f"[{section}] {key} moved: use [{new_section}] {new_key}"
    homes: dict[str, list[str]] = {}
    for new_section, new_key in keys.values():
        homes.setdefault(new_section, []).append(new_key)
    where = "; ".join(f"[{home}] {', '.join(names)}" for home, names in homes.items())
    what = f"[{section}]" if key is None else f"{section}.{key}" if override else f"[{section}] {key}"
    return f"{what}: [{section}] is gone; its keys moved: {where}"


def _apply_override(raw: dict[str, dict[str, str]], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{item}': expected section.key=value or KEY=value")
    section, dot, name = key.strip().rpartition(".")
    if dot and section.strip().lower() in MOVED:
        raise ConfigError(moved(section.strip().lower(), name.strip(), override=True))
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
        if section in MOVED:
            written = list(raw[section])
            raise ConfigError(moved(section, written[0] if written else None))
        if section != TOP and section not in valid_sections:
            raise ConfigError(f"unknown section [{section}]; valid sections: {', '.join(valid_sections)}")
    top = dict(raw.get(TOP, {}))
    implied = translate(top, raw)  # Theano-MPI's BSP_SYNC_TYPE and BSP_EXCH_STRATEGY
    for key in top:
        if key not in (*TOP_KEYS, *DIALECT_KEYS):
            valid = ", ".join(k.upper() for k in (*TOP_KEYS, *DIALECT_KEYS))
            raise ConfigError(
                f"unknown key '{key.upper()}' before the first section; valid bare keys: {valid}"
            )
    for key in TOP_KEYS:
        if not str(top.get(key, "")).strip():
            raise ConfigError(f"missing required key {key.upper()} (a bare key before the first section)")
    devices = top["devices"]
    if isinstance(devices, (list, tuple)):
        devices = ",".join(map(str, devices))
    specs = parse_devices(str(devices))
    size = size_of(top, None if any_size(specs) else len(specs))
    sections = {
        name: build(cls, {**raw.get(name, {}), **implied.get(name, {})}, name)
        for name, cls in SECTIONS.items()
    }
    rule_name = str(top["rule"]).strip()
    return Config(
        rule=rule_name if ":" in rule_name else rule_name.upper(),
        modelfile=str(top["modelfile"]).strip(),
        modelclass=str(top["modelclass"]).strip(),
        devices=specs,
        size=size,
        rule_params={**raw.get("rule", {}), **implied.get("rule", {})},
        model_params=dict(raw.get("model", {})),
        dataset_params=dict(raw.get("dataset", {})),
        source=source,
        **sections,
    )
