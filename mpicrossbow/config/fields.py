"""Typed, range-checked dataclasses built from cfg strings or Python values.

Every component (a cfg section, a rule's hyper-parameters, a model's keyword arguments) declares its settings
as a dataclass. :func:`build` fills one from a mapping whose values are either cfg strings (``"0.1"``,
``"true"``, ``"30,60"``) or already-typed Python values, and raises :class:`~mpicrossbow.errors.ConfigError`
with one line naming the key, what was expected and the valid choices. Ranges live in field metadata made by
:func:`setting`, so the declaration is also the documentation.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

from ..errors import ConfigError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def setting(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with a default, a one-line help text and optional numeric bounds."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use tuples for sequence defaults")
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


def _describe(tp: Any) -> str:
    """A short human name for a type annotation, used in error messages."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a comma-separated list of {_describe(typing.get_args(tp)[0])}"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (a cfg string or a Python value) to annotation ``tp``; errors name ``where``."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{where}: expected {_describe(tp)}, got {value!r}")
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            if type(None) in args:
                return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        choices = typing.get_args(tp)
        text = value.strip() if isinstance(value, str) else value
        for choice in choices:
            if text == choice or (
                isinstance(text, str) and isinstance(choice, str) and text.lower() == choice
            ):
                return choice
        raise ConfigError(f"{where}: {value!r} is not valid; choose one of {', '.join(map(str, choices))}")
    if origin is tuple:
        (item,) = typing.get_args(tp)[:1]
        if isinstance(value, str):
            parts = [p for p in (s.strip() for s in value.replace(";", ",").split(",")) if p]
        elif isinstance(value, (list, tuple)):
            parts = list(value)
        else:
            raise bad
        return tuple(coerce(p, item, where) for p in parts)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        try:
            return int(str(value).strip())
        except ValueError:
            raise bad from None
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            result = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(result):
            raise ConfigError(f"{where}: must be a finite number, got {value!r}")
        return result
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value.strip()
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    raise ConfigError(f"{where}: unsupported setting type {tp!r}")


def check_bounds(value: Any, meta: Mapping[str, Any], where: str) -> None:
    """Raise ConfigError when a number (or each number of a tuple) lies outside the field's bounds."""
    values = value if isinstance(value, tuple) else (value,)
    tests: dict[str, tuple[Callable[[float, float], bool], str]] = {
        "ge": (lambda v, b: v >= b, ">="),
        "gt": (lambda v, b: v > b, ">"),
        "le": (lambda v, b: v <= b, "<="),
        "lt": (lambda v, b: v < b, "<"),
    }
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        for key, (ok, sign) in tests.items():
            if key in meta and not ok(v, meta[key]):
                raise ConfigError(f"{where}: {v} is out of range; must be {sign} {meta[key]}")


def build(cls: type[T], values: Mapping[str, Any], section: str) -> T:
    """Instantiate dataclass ``cls`` from ``values``, coercing types and checking bounds and key names."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, raw in values.items():
        name = key.strip().lower().replace("-", "_")
        if name not in fields or not fields[name].init:
            valid = ", ".join(n for n, f in fields.items() if f.init) or "(none)"
            raise ConfigError(f"[{section}] unknown key '{key}'; valid keys: {valid}")
        where = f"[{section}] {name}"
        kwargs[name] = coerce(raw, hints[name], where)
        check_bounds(kwargs[name], fields[name].metadata, where)
    missing = [
        n
        for n, f in fields.items()
        if f.init
        and n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"[{section}] missing required key '{missing[0]}'")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # cross-field checks in __post_init__
        raise ConfigError(f"[{section}] {exc}") from None


def call_kwargs(fn: Callable[..., Any], values: Mapping[str, Any], section: str) -> dict[str, Any]:
    """Coerce cfg strings to the annotated parameter types of ``fn`` (a model class's ``__init__``)."""
    sig = inspect.signature(fn)
    params = {n: p for n, p in sig.parameters.items() if n != "self" and p.kind is not p.VAR_POSITIONAL}
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: fall back to the raw strings
        hints = {}
    out: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in params and not accepts_any:
            valid = ", ".join(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD) or "(none)"
            raise ConfigError(f"[{section}] unknown key '{key}'; valid keys: {valid}")
        tp = hints.get(key, Any)
        if tp is Any and key in params and params[key].default not in (inspect.Parameter.empty, None):
            tp = type(params[key].default)
        out[key] = guess(raw) if tp is Any else coerce(raw, tp, f"[{section}] {key}")
    return out


def guess(value: Any) -> Any:
    """A cfg string for an untyped parameter (``**kwargs``): an int, a number, a boolean, or the text."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def describe_fields(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type description, default, help) for each field of a settings dataclass, for docs and --help."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = None if f.default is dataclasses.MISSING else f.default
        signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
        bounds = ", ".join(f"{signs[k]} {f.metadata[k]}" for k in signs if k in f.metadata)
        kind = _describe(hints[f.name]) + (f" ({bounds})" if bounds else "")
        rows.append((f.name, kind, default, f.metadata.get("help", "")))
    return rows


def choices(cls: type, name: str) -> tuple[str, ...]:
    """The values a ``Literal`` field of a settings dataclass allows: the one source of an enum's names."""
    return tuple(str(a) for a in typing.get_args(typing.get_type_hints(cls)[name]))
