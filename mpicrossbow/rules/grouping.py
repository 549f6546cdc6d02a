"""Which workers form a GSP group, and which part of the data each rank reads.

* A **groups file** has one group per line: rank numbers and/or host names, separated by spaces or commas
  (``#`` starts a comment). A host name stands for every worker rank on that host. Every worker must be in
  exactly one group; a server rank named by number is an error.
* **Automatic grouping** sorts the workers by their measured seconds per step and starts a new group
  whenever a worker is more than ``ratio`` times slower than the fastest of the current group, so workers of
  similar speed train in lock-step and a straggler gets a group of its own.
* A **shares file** (data sharding) has one ``start end`` pair of fractions per rank of the job, in rank
  order (servers' lines are read and ignored): rank r trains on rows ``[start·n, end·n)`` of the shuffled
  training set instead of an equal share, so a fast group can be given more data.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ConfigError

_SEPARATORS = re.compile(r"[\s,]+")


def _lines(path: str, key: str) -> list[tuple[int, list[str]]]:
    """(line number, tokens) of every non-empty line of ``path``, comments removed."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"[rule] {key} = {path}: cannot read it ({exc.strerror or exc})") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        tokens = [t for t in _SEPARATORS.split(line.split("#", 1)[0]) if t]
        if tokens:
            out.append((number, tokens))
    if not out:
        raise ConfigError(f"[rule] {key} = {path}: the file holds no line")
    return out


def read_groups(path: str, size: int, servers: int) -> list[tuple[int, list[str]]]:
    """The groups of ``path`` as (line number, members); rank numbers are checked against the job."""
    groups = _lines(path, "groups")
    listed: dict[int, int] = {}
    for number, members in groups:
        for token in members:
            if not token.isdigit():
                continue
            rank = int(token)
            if not servers <= rank < size:
                raise ConfigError(
                    f"[rule] groups = {path}, line {number}: rank {rank} is not a worker; workers are ranks "
                    f"{servers}..{size - 1} (ranks 0..{servers - 1} serve the model)"
                )
            if rank in listed:
                raise ConfigError(
                    f"[rule] groups = {path}: rank {rank} is on lines {listed[rank]} and {number}; "
                    "a worker belongs to one group"
                )
            listed[rank] = number
    return groups


def group_of(groups: list[tuple[int, list[str]]], rank: int, hostnames: set[str], path: str) -> int:
    """The index (file order) of the group holding ``rank``, matched by number or by one of ``hostnames``."""
    lines = [
        i
        for i, (_, members) in enumerate(groups)
        if any((t.isdigit() and int(t) == rank) or (not t.isdigit() and t in hostnames) for t in members)
    ]
    if len(lines) != 1:
        where = (
            "no group" if not lines else "groups on lines " + " and ".join(str(groups[i][0]) for i in lines)
        )
        raise ConfigError(
            f"[rule] groups = {path}: rank {rank} (host {sorted(hostnames)[0]}) is in {where}; every worker "
            "must be in exactly one group"
        )
    return lines[0]


def group_by_speed(seconds: list[float], ratio: float) -> list[int]:
    """Group index per worker (0: the fastest group): a new group starts at a worker more than ``ratio``
    times slower than the fastest worker of the current group."""
    order = sorted(range(len(seconds)), key=lambda i: seconds[i])
    groups = [0] * len(seconds)
    index, first = 0, seconds[order[0]] if order else 0.0
    for i in order:
        if seconds[i] > ratio * first:
            index, first = index + 1, seconds[i]
        groups[i] = index
    return groups


def read_shares(path: str, size: int, servers: int) -> list[tuple[float, float]]:
    """One ``(start, end)`` fraction pair per rank of a ``size``-rank job; the first ``servers`` lines are
    placeholders (any two numbers)."""
    rows = _lines(path, "shares")
    if len(rows) != size:
        raise ConfigError(
            f"[rule] shares = {path}: {len(rows)} line(s) for a {size}-rank job; write one 'start end' "
            "pair per rank, in rank order (servers' lines are ignored)"
        )
    shares = []
    for rank, (number, tokens) in enumerate(rows):
        try:
            start, end = (float(t) for t in tokens)
        except ValueError:
            raise ConfigError(
                f"[rule] shares = {path}, line {number}: expected two fractions 'start end', got "
                f"{' '.join(tokens)!r}"
            ) from None
        if rank >= servers and not 0.0 <= start < end <= 1.0:
            raise ConfigError(
                f"[rule] shares = {path}, line {number}: need 0 <= start < end <= 1, got {start} {end}"
            )
        shares.append((start, end))
    return shares
