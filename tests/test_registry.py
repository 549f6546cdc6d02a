"""Rule registry: built-in names, user rules by module:Class, and errors that list the valid names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.rules import BSP, RULES
from mpicrossbow.rules.registry import build_rule

USER_RULE = """
from dataclasses import dataclass
from mpicrossbow import Rule
from mpicrossbow.config.fields import setting

class Halve(Rule):
    @dataclass(frozen=True)
    class Config:
        factor: float = setting(0.5, "scale", gt=0, le=1)

class NotARule:
    pass
"""


def test_lookup_is_case_insensitive() -> None:
    assert RULES.get("bsp") is BSP is RULES.get("BSP")


def test_user_rule_by_module_and_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rules.py").write_text(USER_RULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        text="RULE=my_rules:Halve\nMODELFILE=m\nMODELCLASS=M\nDEVICES=cpu\n[rule]\nfactor=0.25\n"
    )
    assert cfg.rule == "my_rules:Halve" and build_rule(cfg.rule, cfg.rule_params).hyper.factor == 0.25
    with pytest.raises(ConfigError, match=r"\[rule\] factor: 2.0 is out of range; must be <= 1"):
        RULES.get("my_rules:Halve")(factor=2)
    with pytest.raises(ConfigError, match="'NotARule' in my_rules is not a subclass of Rule"):
        RULES.get("my_rules:NotARule")
    with pytest.raises(ConfigError, match="cannot import module 'nope_rules'"):
        RULES.get("nope_rules:X")
    sys.modules.pop("my_rules", None)
