"""mpicrossbow: train PyTorch models on HPC clusters with MPI — learner pools and pluggable exchange rules.

Start a job with ``crossbow-launch -cfg session.cfg`` (under ``mpirun`` or on its own), or from Python with
``rule = BSP(); rule.init(devices=[...], modelfile=..., modelclass=...); rule.wait()``.
"""

from .config import Config, load_config
from .errors import ConfigError, ContractError, DataError, UsageError
from .model import TorchModel
from .rules import BSP, RULES, Rule
from .shard import Shard

__version__ = "0.1.0"

__all__ = [
    "BSP",
    "RULES",
    "Config",
    "ConfigError",
    "ContractError",
    "DataError",
    "Rule",
    "Shard",
    "TorchModel",
    "UsageError",
    "__version__",
    "load_config",
]
