"""Theano-MPI's session.cfg dialect: what its ``tmlauncher`` read from a cfg, mapped onto this project's keys.

``tmlauncher`` ``source``-d the cfg as bash, so its examples write values in quotes
(``BSP_EXCH_STRATEGY='ar'``) and a multi-node DEVICES as a bash array over several lines::

    DEVICES=("node0:cuda0"
             "node1:cuda0,cuda1,cuda2")

:func:`normalise_text` turns the bare part of a cfg (before the first ``[section]``) into plain ``KEY=value``
lines (the array becomes ``node0:cuda0 node1:cuda0,cuda1,cuda2``, which DEVICES' parser reads as hosts);
:func:`translate` maps the keys ``tmlauncher`` knew beyond RULE, MODELFILE, MODELCLASS and DEVICES:

* ``SIZE`` — the number of ranks: checked against DEVICES here and against the job's size when it starts;
* ``BSP_SYNC_TYPE`` — ``avg`` (average the weights after each step) → ``[rule] mode = avg``; ``cdd`` (average
  the updates) → ``mode = grad``; ``swap`` (its GAN pairing: random pairs of ranks swap weights) → ``mode =
  swap``; RULE=BSP only;
* ``BSP_EXCH_STRATEGY`` — ``ar`` (MPI allreduce) → ``[comm] backend = mpi``; ``nccl32`` → ``nccl``;
  ``nccl16`` → ``nccl`` with ``compression = fp16``.

Values Theano-MPI had but this project does not (its ``copper``/``asa`` strategies) are one ConfigError naming
the supported ones.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

#: BSP_SYNC_TYPE → BSP's ``[rule] mode``.
SYNC_TYPES = {"avg": "avg", "cdd": "grad", "swap": "swap"}
#: BSP_EXCH_STRATEGY → ``[comm]`` keys.
EXCH_STRATEGIES: dict[str, dict[str, str]] = {
    "ar": {"backend": "mpi"},
    "nccl32": {"backend": "nccl"},
    "nccl16": {"backend": "nccl", "compression": "fp16"},
}
#: Bare keys of the dialect (lower case), beyond the four every cfg has.
DIALECT_KEYS = ("size", "bsp_sync_type", "bsp_exch_strategy")
_ARRAY = re.compile(r"^([ \t]*[A-Za-z_]\w*)[ \t]*=[ \t]*\((.*?)\)[ \t]*$", re.M | re.S)
_QUOTED = re.compile(r"""^([ \t]*[A-Za-z_]\w*[ \t]*=[ \t]*)(['"])(.*)\2[ \t]*$""", re.M)


def normalise_text(text: str) -> str:
    """The cfg with its bare part in plain ``KEY=value`` lines: bash arrays joined, quotes taken off."""
    match = re.search(r"^[ \t]*\[", text, re.M)
    bare, rest = (text[: match.start()], text[match.start() :]) if match else (text, "")

    def join(array: re.Match[str]) -> str:
        entries = re.findall(r"""'([^']*)'|"([^"]*)"|([^\s'"]+)""", array[2])
        return f"{array[1]}={' '.join(a or b or c for a, b, c in entries)}"

    bare = _ARRAY.sub(join, bare)
    bare = _QUOTED.sub(lambda m: f"{m[1]}{m[3]}", bare)
    return bare + rest


def translate(top: dict[str, Any], raw: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Take the dialect's keys out of ``top``; the ``[rule]``/``[comm]`` values they stand for, which a
    section of the cfg that says otherwise contradicts (a ConfigError)."""
    extra: dict[str, dict[str, Any]] = {}
    sync = str(top.pop("bsp_sync_type", "")).strip().lower()
    if sync:
        if str(top.get("rule", "")).strip().upper() != "BSP":
            raise ConfigError(f"BSP_SYNC_TYPE={sync} applies to RULE=BSP only, not RULE={top.get('rule')}")
        if sync not in SYNC_TYPES:
            raise ConfigError(
                f"BSP_SYNC_TYPE={sync} is not supported; supported: "
                + ", ".join(f"{k} (BSP mode {v})" for k, v in SYNC_TYPES.items())
            )
        extra["rule"] = {"mode": SYNC_TYPES[sync]}
    strategy = str(top.pop("bsp_exch_strategy", "")).strip().lower()
    if strategy:
        if strategy not in EXCH_STRATEGIES:
            raise ConfigError(
                f"BSP_EXCH_STRATEGY={strategy} is not supported; supported: "
                + ", ".join(
                    f"{k} ({', '.join(f'{a} = {b}' for a, b in v.items())})"
                    for k, v in EXCH_STRATEGIES.items()
                )
            )
        extra["comm"] = dict(EXCH_STRATEGIES[strategy])
    for section, values in extra.items():
        for key, value in values.items():
            written = raw.get(section, {}).get(key)
            if written is not None and str(written).strip().lower() != value:
                raise ConfigError(
                    f"[{section}] {key} = {written} contradicts the Theano-MPI key that sets it to {value}"
                )
    return extra


def size_of(top: dict[str, Any], devices: int | None) -> int | None:
    """``SIZE`` taken out of ``top`` (None without it), checked against ``devices`` entries when DEVICES
    lists one per rank."""
    text = str(top.pop("size", "")).strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"SIZE={text}: expected the number of ranks, a whole number of at least 1")
    if devices is not None and devices != int(text):
        raise ConfigError(f"SIZE={text} but DEVICES lists {devices} device(s): they must agree")
    return int(text)
