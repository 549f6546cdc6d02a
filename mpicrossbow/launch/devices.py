"""The ``DEVICES`` list: which device each rank drives.

Accepted forms, comma-separated (Theano-MPI's syntax plus CPU entries):

* ``cuda0,cuda1`` — GPU index per rank, ranks in order;
* ``cpu0,cpu1`` — CPU ranks (the number only labels it);
* ``cpu`` alone — every rank on the CPU, as many ranks as the MPI launcher starts (run without one,
  ``crossbow-launch`` starts one rank per usable core, or ``-np N``);
* ``host:cuda0,cuda1`` — devices on a named host; several hosts separated by spaces or ``;``
  (``nodeA:cuda0,cuda1 nodeB:cuda0,cuda1``). Rank r takes the r-th device of the whole list.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

_ENTRY = re.compile(r"^(cuda|cpu)(\d*)$")


@dataclass(frozen=True)
class DeviceSpec:
    """One entry of DEVICES: a kind (``cuda``/``cpu``), an index and optionally the host it must run on."""

    kind: str
    index: int | None = None
    host: str | None = None

    def __str__(self) -> str:
        text = f"{self.kind}{'' if self.index is None else self.index}"
        return f"{self.host}:{text}" if self.host else text

    def torch_device(self) -> torch.device:
        """The torch device for this entry; a CUDA entry without CUDA is a ConfigError."""
        import torch  # here, not at the top: parsing DEVICES in crossbow-launch's own process needs no torch

        if self.kind == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError(  # the same words on every rank, so a job prints it once
                f"DEVICES names CUDA devices but CUDA is not available here (torch {torch.__version__}): "
                "run on a GPU node with a CUDA build of torch, or set DEVICES=cpu"
            )
        index = self.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"DEVICES: {self} requested but only {torch.cuda.device_count()} CUDA devices exist"
            )
        return torch.device("cuda", index)


def parse_devices(text: str) -> tuple[DeviceSpec, ...]:
    """Parse a DEVICES value into specs; ConfigError names the first bad entry and lists the valid forms."""
    specs: list[DeviceSpec] = []
    for group in re.split(r"[\s;]+", text.strip()):
        if not group:
            continue
        host: str | None = None
        if ":" in group:
            host, _, group = group.partition(":")
            if not host:
                raise ConfigError(f"DEVICES: empty host name before ':' in {text!r}")
        for entry in filter(None, (e.strip() for e in group.split(","))):
            match = _ENTRY.match(entry.lower())
            if not match:
                raise ConfigError(
                    f"DEVICES: unknown device '{entry}'; valid forms: cudaN, cpu, cpuN, host:cuda0,cuda1"
                )
            index = int(match.group(2)) if match.group(2) else None
            specs.append(DeviceSpec(match.group(1), index, host))
    if not specs:
        raise ConfigError("DEVICES: the list is empty; give one device per rank, e.g. DEVICES=cpu0,cpu1")
    return tuple(specs)


def any_size(specs: tuple[DeviceSpec, ...]) -> bool:
    """True for ``DEVICES=cpu``: one CPU entry without index or host, valid for any number of ranks."""
    return specs == (DeviceSpec("cpu"),)


def host_matches(wanted: str, hostname: str | None = None) -> bool:
    """True when ``wanted`` names this machine (short name, full name or ``localhost``)."""
    hostname = hostname or socket.gethostname()
    if wanted in ("localhost", "127.0.0.1"):
        return True
    return wanted in {hostname, hostname.split(".")[0], socket.getfqdn()}


def device_for_rank(specs: tuple[DeviceSpec, ...], rank: int, size: int) -> DeviceSpec:
    """The spec rank ``rank`` drives; the list must have exactly one entry per rank (or be ``cpu``)."""
    if any_size(specs):
        return specs[0]
    if len(specs) != size:
        raise ConfigError(
            f"DEVICES lists {len(specs)} device(s) ({','.join(map(str, specs))}) but the job has {size} "
            f"rank(s); give one device per rank or start the job with -n {len(specs)}"
        )
    spec = specs[rank]
    if spec.host and not host_matches(spec.host):
        raise ConfigError(f"DEVICES: rank {rank} is on host {socket.gethostname()} but its entry is {spec}")
    return spec
