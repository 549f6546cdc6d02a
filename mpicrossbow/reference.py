"""The session.cfg reference page, ``docs/config.md``, generated from the settings' own help strings.

Every key of every section is a field of a settings dataclass (:data:`mpicrossbow.config.SECTIONS`, and each
rule's ``Config`` in :data:`mpicrossbow.rules.RULES`) whose type, bounds, default and help the page is
written from, so the reference cannot drift from the code. Regenerate it with::

    python -m mpicrossbow.reference > docs/config.md

``tests/test_readme.py`` checks that the committed page equals :func:`config_reference`.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

from .config import SECTIONS, TOP_KEYS
from .config.fields import describe_fields
from .config.session_cfg import format_value
from .rules import RULES

#: The bare Theano-MPI keys: what each one means (they are plain strings, not settings with help).
BARE_KEYS: dict[str, str] = {
    "rule": "exchange rule: a built-in name (`BSP`; every one is in [the rules](rules.md)) or `module:Class` "
    "for your own `Rule` subclass",
    "modelfile": "the model file: a module path from the working directory (`models.lenet`) or a path to a "
    "`.py` file",
    "modelclass": "the class in MODELFILE (see [the model contract](models.md))",
    "devices": "one device per rank: `cuda0,cuda1`, `cpu0,cpu1`, or `host:cuda0,cuda1 host2:cuda0`; `cpu` "
    "alone: every rank on the CPU, any number of ranks",
}

#: The page that explains what a section's settings do, for the sections that have one.
SEE_ALSO: dict[str, str] = {
    "session": "[outputs](outputs.md)",
    "data": "[data](data.md)",
    "pool": "[learner pools](pools.md)",
    "comm": "[communication](communication.md)",
    "numa": "[core binding](binding.md)",
    "checkpoint": "[reliability](reliability.md)",
    "watchdog": "[reliability](reliability.md)",
    "elastic": "[reliability](reliability.md)",
    "inject": "[reliability](reliability.md)",
}

HEADER = """\
# session.cfg reference

*Generated from the settings' own help strings by `python -m mpicrossbow.reference > docs/config.md`:
change a help string in the code, then regenerate this page (a test checks that it is current).*

A cfg is INI. Theano-MPI's **bare keys** come before any section and work unchanged; all four are
required. Then come sections. Unknown sections or keys, wrong types and out-of-range values are one line
naming the key and exit status 2 on every rank, before any rank trains. The old `[fault]` section was split
in two: elastic training's keys are in `[elastic]` (`fault.elastic` is `elastic.enabled`), the drills in
`[inject]`; an old key is refused in one line naming its new one.

```ini
RULE=BSP
MODELFILE=models.mlp
MODELCLASS=MLP
DEVICES=cpu

[session]
epochs = 20
[optim]
lr = 0.05
[rule]          # the rule's own hyper-parameters
mode = grad
[model]         # keyword arguments of MODELCLASS
hidden = 128
```

Every key can be overridden on the command line with one syntax, `section.key=value` (or `KEY=value` for a
bare key): `crossbow-launch -cfg session.cfg optim.lr=0.05 session.epochs=3 RULE=BSP`.
`crossbow-launch -cfg session.cfg --print-config` prints the resolved cfg and starts nothing. Rank 0 writes
the fully resolved cfg (defaults included) to `session.cfg` in the run folder; feeding it back to
`crossbow-launch` repeats the run.
"""

MODEL_SECTION = """\
## [model]

Keyword arguments of MODELCLASS (torch-native form), converted to the types its `__init__` annotates;
unknown names are errors listing the valid ones. In the Theano-MPI form they are added to the `config` dict
the class receives. See [the model contract](models.md).
"""


DATASET_SECTION = """\
## [dataset]

Keyword arguments of the `[data] dataset` factory, converted to the types it annotates; unknown names are
errors listing the valid ones. The factory is called as `factory(split, **[dataset])` for `split` = `train`
and `val` and returns a map-style `torch.utils.data.Dataset` of `(input, target)`; image data sets also get
`[data]`'s `augment`, `image_size` and `on_bad_sample`. See [data](data.md).
"""


def _dataset_rows() -> list[str]:
    """One table row per built-in data set: its factory and keyword arguments (from the signature)."""
    from .data.registry import BUILTIN, dataset_factory

    rows = ["| name | factory | keys |", "|---|---|---|"]
    for name, spec in BUILTIN.items():
        try:
            params = inspect.signature(dataset_factory(name)).parameters.values()
        except Exception:  # a reader that needs the repository's data/ package, not importable here
            rows.append(f"| `{name}` | `{spec}` | |")
            continue
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        keys = ", ".join(
            f"`{p.name}`" + ("" if p.default is inspect.Parameter.empty else f" ({p.default!r})")
            for p in params
            if p.kind in named and p.name not in ("self", "split", "augment", "image_size", "on_bad_sample")
        )
        rows.append(f"| `{name}` | `{spec}` | {keys} |")
    return rows


def _markdown(text: str) -> str:
    """reStructuredText inline markup of a docstring (``literal``, :role:`target`) as Markdown."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _summary(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line, as Markdown."""
    first = inspect.cleandoc(doc or "").split("\n\n", 1)[0]
    return _markdown(" ".join(line.strip() for line in first.splitlines()))


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: no column breaks, nothing read as an HTML tag."""
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text.replace("|", "\\|"))


def _default(value: Any) -> str:
    """A default as it is written in a cfg (booleans lower-case, lists comma-separated)."""
    if value is None:
        return "(unset)"
    text = format_value(value)
    return f"`{text}`" if text else "(empty)"


def _table(cls: type) -> list[str]:
    """The key / type / default / meaning table of a settings dataclass."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, kind, default, help_text in describe_fields(cls):
        rows.append(f"| `{key}` | {_cell(kind)} | {_cell(_default(default))} | {_cell(help_text)} |")
    return rows


def _bare_keys() -> list[str]:
    """The table of the four bare Theano-MPI keys."""
    rows = ["## Bare keys", "", "| key | meaning |", "|---|---|"]
    rows += [f"| `{key.upper()}` | {_cell(BARE_KEYS[key])} |" for key in TOP_KEYS]
    return rows


def _section(name: str, cls: type) -> list[str]:
    """One ``[name]`` section: its docstring's summary, where to read more, and its keys."""
    summary = _summary(cls.__doc__)
    summary = re.sub(rf"^`\[{name}\]`:\s*", "", summary)
    summary = summary[:1].upper() + summary[1:]
    see = f" See {SEE_ALSO[name]}." if name in SEE_ALSO else ""
    return [f"## [{name}]", "", summary + see, "", *_table(cls)]


def _rule_sections() -> list[str]:
    """The ``[rule]`` section: one sub-section per registered rule with its hyper-parameters."""
    lines = [
        "## [rule]",
        "",
        "The hyper-parameters of the rule RULE names; which keys are valid depends on the rule (a key of",
        "another rule is an error listing the valid ones). What each rule computes:",
        "[the rules](rules.md).",
    ]
    for name in RULES.names():
        cls = RULES.get(name)
        fields = describe_fields(cls.Config)
        lines += [
            "",
            f"### RULE={name}",
            "",
            f"{_summary(cls.__doc__)} See [{name}](rules.md#{name.lower()}).",
        ]
        note = _summary(cls.Config.__doc__)
        if note not in (f"{name} hyper-parameters.", "No hyper-parameters."):
            lines += ["", note]
        lines += ["", *(_table(cls.Config) if fields else ["No hyper-parameters."])]
    return lines


def config_reference() -> str:
    """The whole ``docs/config.md`` page: bare keys, every section's keys, every rule's, and ``[model]``."""
    lines = [HEADER.rstrip("\n"), "", *_bare_keys()]
    for name, cls in SECTIONS.items():
        lines += ["", *_section(name, cls)]
    lines += ["", *_rule_sections(), "", MODEL_SECTION.rstrip("\n")]
    lines += ["", DATASET_SECTION.rstrip("\n"), "", *_dataset_rows()]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Write the page to standard output as UTF-8 (``python -m mpicrossbow.reference > docs/config.md``)."""
    sys.stdout.buffer.write(config_reference().encode("utf-8"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
