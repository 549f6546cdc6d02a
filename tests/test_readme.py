"""The README is the user's guide and its commands are what CI runs; docs/ holds the reference, whose cfg page
is generated from the settings' own help strings, and nothing points outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO
from mpicrossbow.reference import config_reference
from mpicrossbow.rules import RULES

README = (REPO / "README.md").read_text(encoding="utf-8")
DOCS = REPO / "docs"
MAX_README_LINES = 250
#: The pages whose relative links must resolve.
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "benchmarks" / "README.md"]
#: Where the repository's own text lives (binary files such as plots and HDF5 data are skipped).
CHECKED = ["README.md", "docs", "mpicrossbow", "tests", "benchmarks", "launch"]
TEXT_SUFFIXES = {".md", ".py", ".cfg", ".sbatch", ".txt", ".xml", ".ini", ".toml", ".sh", ""}
# Spelled in pieces so that this file does not name them itself.
FOREIGN_FILES = ("ALGORITHMS" + ".md", "DESIGN" + ".md")
FOREIGN_ROOTS = re.compile(r"(?<![\w.])/(?:" + "|".join(("work", "home", "Users", "root")) + r")/")


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_command = bash_blocks()[1].strip()
    assert "pytest" in test_command
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()


def test_first_command_runs_the_default_job() -> None:
    assert bash_blocks()[0].strip().endswith("crossbow-launch -cfg launch/digits.cfg")
    assert (REPO / "launch" / "digits.cfg").exists()


def test_cfg_reference_is_generated_from_the_help_strings() -> None:
    committed = (DOCS / "config.md").read_text(encoding="utf-8")
    assert committed == config_reference(), (
        "docs/config.md is not what the settings' help strings generate; regenerate it with "
        "`python -m mpicrossbow.reference > docs/config.md` and commit it"
    )


def test_every_rule_has_a_readme_line_and_a_section_in_docs_rules() -> None:
    rules_page = (DOCS / "rules.md").read_text(encoding="utf-8")
    for rule in RULES.names():
        assert re.search(rf"^\| `{rule}` \| .+ \|$", README, flags=re.M), (
            f"{rule}: no line in README's rule table"
        )
        assert re.search(rf"^## {rule}$", rules_page, flags=re.M), f"{rule}: no '## {rule}' in docs/rules.md"


def test_readme_is_a_short_guide() -> None:
    lines = len(README.splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move it to docs/"
    )


def _text_files() -> list[Path]:
    files: list[Path] = []
    for name in CHECKED:
        path = REPO / name
        found = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        files += [p for p in found if p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return files


def test_nothing_refers_outside_the_repository() -> None:
    problems = []
    for path in _text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        where = path.relative_to(REPO)
        problems += [f"{where} names {name}" for name in FOREIGN_FILES if name in text]
        problems += [f"{where}: absolute path {m.group()}..." for m in FOREIGN_ROOTS.finditer(text)]
        for m in re.finditer(r"(?:\.\./)+[\w./-]*", text):
            target = (path.parent / m.group()).resolve()
            if not target.is_relative_to(REPO.resolve()):
                problems.append(f"{where}: {m.group()} leaves the repository")
    assert not problems, "\n".join(problems)


def _without_code(text: str) -> str:
    """Markdown without its fenced code blocks (no links or headings there)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (duplicates get -1, -2, ...)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _without_code(page.read_text(encoding="utf-8")), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def test_every_relative_link_in_the_guide_and_docs_resolves() -> None:
    broken = []
    for page in PAGES:
        text = _without_code(page.read_text(encoding="utf-8"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z+.-]*:", target):  # http:, https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)
