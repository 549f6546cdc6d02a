"""Exchange rules: look one up by name in :data:`RULES`, or import one (``from mpicrossbow import BSP``)."""

from .asgd import ASGD
from .auto import Auto
from .base import Rule
from .bsp import BSP
from .diloco import DiLoCo
from .easgd import EASGD
from .gosgd import GOSGD
from .gsp import GSP
from .localsgd import LocalSGD
from .postlocalsgd import PostLocalSGD
from .psgd import PSGD
from .registry import RULES
from .sma import SMA
from .ssp import SSP
from .weedout import WeedOut

__all__ = [
    "ASGD",
    "BSP",
    "EASGD",
    "GOSGD",
    "GSP",
    "PSGD",
    "RULES",
    "SMA",
    "SSP",
    "Auto",
    "DiLoCo",
    "LocalSGD",
    "PostLocalSGD",
    "Rule",
    "WeedOut",
]
