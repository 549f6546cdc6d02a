"""mpicrossbow: train PyTorch models on HPC clusters with MPI — learner pools and pluggable exchange rules.

Start a job with ``crossbow-launch -cfg session.cfg`` (under ``mpirun`` or on its own), from Python with
``rule = BSP(); rule.init(devices=[...], modelfile=..., modelclass=...); rule.wait()``, or put a rule into
your own training loop: ``import mpicrossbow as xb``, ``world = xb.init()`` (first; ``world.rank``,
``.size``, ``.device``), ``xb.shard(...)``, ``xb.distribute(model, optimizer, rule="SMA")``,
``with xb.consensus(model): ...``, ``xb.finish()`` (:mod:`mpicrossbow.embed`).

Names are resolved on first use (PEP 562), so ``crossbow-launch`` on its way to ``mpiexec`` imports no torch.
Every rule class exported here (``BSP``, ``SMA``, ``EASGD``, ..., and ``Rule`` for your own) carries
Theano-MPI's ``init``/``wait`` facade (:mod:`mpicrossbow.compat.facade`).
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CheckpointError, ConfigError, ContractError, DataError, UsageError

__version__ = "0.1.0"

#: Rule classes exported with the Theano-MPI facade: exported name → name in ``mpicrossbow.rules``.
_RULES = (
    "ASGD",
    "Auto",
    "BSP",
    "DiLoCo",
    "EASGD",
    "GOSGD",
    "GSP",
    "LocalSGD",
    "PostLocalSGD",
    "PSGD",
    "SMA",
    "SSP",
    "WeedOut",
    "Rule",
)
#: Other lazily imported names → the module that defines them.
_LAZY = {
    "RULES": "mpicrossbow.rules.registry",
    "Config": "mpicrossbow.config",
    "load_config": "mpicrossbow.config",
    "TorchModel": "mpicrossbow.model",
    "Shard": "mpicrossbow.model",
    "Residual": "mpicrossbow.model",
    "JobFailed": "mpicrossbow.compat.jobs",
    "RunResult": "mpicrossbow.training.reporting.result",
    # the embedded API: import mpicrossbow as xb; xb.init(); xb.distribute(model, optimizer, rule="SMA")
    "init": "mpicrossbow.embed",
    "shard": "mpicrossbow.embed",
    "distribute": "mpicrossbow.embed",
    "consensus": "mpicrossbow.embed",
    "finish": "mpicrossbow.embed",
    "checkpoint": "mpicrossbow.embed",
    "restore": "mpicrossbow.embed",
    "trains": "mpicrossbow.embed",
    "noise_scale": "mpicrossbow.embed",
    "allreduce": "mpicrossbow.embed",
    "keep": "mpicrossbow.embed",
    "epochs": "mpicrossbow.embed",
    "GradScaler": "mpicrossbow.embed",
}

__all__ = [
    *_RULES,
    *_LAZY,
    "CheckpointError",
    "ConfigError",
    "ContractError",
    "DataError",
    "UsageError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """Import a public name on first use."""
    if name in _RULES:
        facade = importlib.import_module("mpicrossbow.compat.facade")
        rules = importlib.import_module("mpicrossbow.rules")
        value = facade.with_facade(getattr(rules, name))
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'mpicrossbow' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
