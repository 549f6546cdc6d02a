"""Exchange rules: look one up by name in :data:`RULES`, or import one (``from mpicrossbow import BSP``)."""

from .base import Rule
from .bsp import BSP
from .registry import RULES

__all__ = ["BSP", "RULES", "Rule"]
