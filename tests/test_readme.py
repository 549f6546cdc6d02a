"""The README is the user's contract: its commands are what CI runs, and it documents every cfg key."""

from __future__ import annotations

import re

from conftest import REPO
from mpicrossbow.config import SECTIONS
from mpicrossbow.config.fields import describe_fields
from mpicrossbow.rules import RULES

README = (REPO / "README.md").read_text(encoding="utf-8")


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_command = bash_blocks()[1].strip()
    assert "pytest" in test_command
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()


def test_first_command_runs_the_default_job() -> None:
    assert bash_blocks()[0].strip().endswith("crossbow-launch -cfg launch/digits.cfg")
    assert (REPO / "launch" / "digits.cfg").exists()


def test_every_cfg_key_and_rule_is_documented() -> None:
    for name, cls in SECTIONS.items():
        assert f"**[{name}]**" in README
        for key, *_ in describe_fields(cls):
            assert f"| `{key}` |" in README, f"[{name}] {key} missing from README"
    for rule in RULES.names():
        assert f"| `{rule}` |" in README
        for key, *_ in describe_fields(RULES.get(rule).Config):
            assert f"`{key}`" in README
