"""session.cfg: Theano-MPI's bare keys plus INI sections, read into one small frozen dataclass per component.

:mod:`.sections` declares the sections (each field with its help string), :mod:`.fields` coerces and checks
values, :mod:`.loader` reads files and ``section.key=value`` overrides into a :class:`Config`. Config never
imports a plug-in: ``[rule]`` stays as written until the rule registry builds the rule, which validates it.
"""

from .sections import (
    CheckpointSection,
    CommSection,
    DataSection,
    ElasticSection,
    InjectSection,
    LinkSection,
    NumaSection,
    OptimSection,
    PoolSection,
    SessionSection,
    WatchdogSection,
)
from .session_cfg import FREE_SECTIONS, SECTIONS, TOP, TOP_KEYS, Config, from_raw, load_config

__all__ = [
    "FREE_SECTIONS",
    "SECTIONS",
    "TOP",
    "TOP_KEYS",
    "CheckpointSection",
    "CommSection",
    "Config",
    "DataSection",
    "ElasticSection",
    "InjectSection",
    "LinkSection",
    "NumaSection",
    "OptimSection",
    "PoolSection",
    "SessionSection",
    "WatchdogSection",
    "from_raw",
    "load_config",
]
