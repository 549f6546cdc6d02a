"""House rule: the tree is ruff clean (lint and format), checked on every CI run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def ruff() -> str:
    path = Path(sys.executable).parent / "ruff"
    found = str(path) if path.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return found


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_clean(args: list[str]) -> None:
    proc = subprocess.run([ruff(), *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
