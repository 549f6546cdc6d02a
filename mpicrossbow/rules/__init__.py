"""Exchange rules: look one up by name in :data:`RULES`, or import one (``from mpicrossbow import BSP``)."""

from .base import Rule
from .bsp import BSP
from .diloco import DiLoCo
from .easgd import EASGD
from .gosgd import GOSGD
from .localsgd import LocalSGD
from .registry import RULES
from .sma import SMA

__all__ = ["BSP", "EASGD", "GOSGD", "RULES", "SMA", "DiLoCo", "LocalSGD", "Rule"]
