"""The rule registry: ``RULE=BSP`` or ``RULE=mypkg.rules:MyRule``."""

from __future__ import annotations

from ..registry import Registry
from .base import Rule

#: Every built-in rule registers here; unknown names get an error listing these.
RULES: Registry[Rule] = Registry("rule", Rule)
