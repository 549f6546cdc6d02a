"""Exchange rules. Import a rule by name through :data:`RULES`, or directly: ``from mpicrossbow.rules import BSP``."""

from .base import Rule
from .bsp import BSP
from .registry import RULES

__all__ = ["BSP", "RULES", "Rule"]
