"""The rule registry: ``RULE=BSP`` or ``RULE=mypkg.rules:MyRule``, and the one place ``[rule]`` is checked."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..registry import Registry
from .base import Rule
from .lr_recipe import uncapped_scaling

#: Every built-in rule registers here; unknown names get an error listing these.
RULES: Registry[Rule] = Registry("rule", Rule)


def build_rule(name: str, params: Mapping[str, Any]) -> Rule:
    """The rule ``RULE=name`` names, built from the ``[rule]`` keys (strings or typed values).

    Its ``Config`` dataclass validates them: an unknown key, a bad value or an unknown rule name is one
    ConfigError naming the key (or listing the valid names).
    """
    return RULES.get(name)(**params)


def resolve(config: Config, rule: Rule | None = None) -> tuple[Rule, Config]:
    """The rule ``config`` names (or ``rule``, already built), and ``config`` with that rule's
    hyper-parameters resolved, defaults included: what session.cfg records and ``--print-config`` shows."""
    rule = rule if rule is not None else build_rule(config.rule, config.rule_params)
    problem = uncapped_scaling(rule, config.optim.lr_scaling, config.optim.lr_cap, LR_KEYS)
    if problem:
        raise ConfigError(problem)
    return rule, config.replace(rule_params=dataclasses.asdict(rule.hyper))


#: How the cfg names the two settings :func:`~.lr_recipe.uncapped_scaling` weighs.
LR_KEYS = ("[optim] lr_scaling", "[optim] lr_cap")
