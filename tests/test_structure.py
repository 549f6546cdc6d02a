"""The package's shape, as the house rules state it: an acyclic import graph (function-level imports and
``importlib.import_module("...")`` included), no function longer than 80 lines, a Session that only
assembles. Read from the source with :mod:`ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "mpicrossbow"
MAX_FUNCTION_LINES = 80
MAX_SESSION_LINES = 300


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports anywhere in its body (resolved to modules, not names)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{a.name}" for a in node.names} & set(known)  # `from pkg import module`
            targets.update(submodules)
            if len(submodules) < len(node.names):  # some names come from the module (or package) itself
                targets.add(source)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            targets.add(str(node.args[0].value))
    return {t for t in targets if t in known and t != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_has_no_cycle() -> None:
    known = modules()
    graph = {name: imported(path, known) for name, path in known.items()}
    # A package's __init__ runs before its submodules; a submodule importing its own package's __init__
    # (directly or not) while __init__ imports it back is a cycle too, so __init__ modules stay in the graph.
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_function_is_longer_than_80_lines() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions longer than 80 lines: " + "; ".join(long)


def test_session_only_assembles() -> None:
    lines = len((PACKAGE / "training" / "session.py").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_SESSION_LINES, f"training/session.py has {lines} lines (at most {MAX_SESSION_LINES})"


#: Where a rule's step hooks are called: the step sequence itself, and a rule delegating to the rule it wraps.
STEP_SEQUENCE = "mpicrossbow/training/step.py"


def own_calls(node: ast.AST) -> set[str]:
    """The attribute names ``node`` calls in its own body (``x.name(...)``), not inside a nested function or
    class, which count for themselves."""
    calls, todo = set(), list(ast.iter_child_nodes(node))
    while todo:
        child = todo.pop()
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
            calls.add(child.func.attr)
        todo.extend(ast.iter_child_nodes(child))
    return calls


def sequence_writers(sources: dict[str, str]) -> list[str]:
    """``path:function`` of every function (or module body) in ``sources`` (path → code) that writes a step
    sequence of its own: it calls a rule's ``on_gradients`` — the hook between backward and the optimizer —
    outside training/step.py, or a pool's ``apply`` together with a rule's ``exchange``. A rule's own
    ``on_gradients``/``exchange`` forwarding to a rule it wraps (POSTLOCALSGD) is delegation, not a copy."""
    writers = []
    for path, code in sources.items():
        if path == STEP_SEQUENCE:
            continue
        for node in ast.walk(ast.parse(code)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module):
                continue
            if getattr(node, "name", "") in ("on_gradients", "exchange"):
                continue
            calls = own_calls(node)
            if "on_gradients" in calls or {"apply", "exchange"} <= calls:
                writers.append(f"{path}:{getattr(node, 'name', '<module>')}")
    return sorted(set(writers))


def test_train_step_is_the_only_place_the_step_sequence_is_written() -> None:
    """Whoever drives a pool and a rule (the loop, the embedded API's hooks, tests, MPI scripts, benchmarks)
    goes through training/step.py (``train_step``, or ``rule_gradients``/``rule_exchange`` around a user's own
    optimizer step): no second copy of the sequence anywhere."""
    sources = {
        str(path.relative_to(REPO)): path.read_text(encoding="utf-8")
        for folder in ("mpicrossbow", "tests", "benchmarks", "examples")
        for path in sorted((REPO / folder).rglob("*.py"))
    }
    assert sequence_writers(sources) == []


def test_a_second_copy_of_the_step_sequence_fails_the_structure_test() -> None:
    """The embedded hooks as they were before they called training/step.py, and a loop of one's own."""
    hooks = """
class StepHooks:
    def _before(self, optimizer, args, kwargs):
        self.own.learner.gather_grads()
        self.rule.on_gradients(self.step)

    def _after(self, optimizer, args, kwargs):
        self.rule.exchange(self.step)
"""
    loop = """
def my_step(pool, rule, step):
    pool.compute(step)
    pool.apply()
    rule.exchange(step)
"""
    delegation = """
class Wrapper:
    def on_gradients(self, step):
        self.active.on_gradients(step)
"""
    sources = {"a/hooks.py": hooks, "b/loop.py": loop, "c/wrapper.py": delegation, STEP_SEQUENCE: loop}
    assert sequence_writers(sources) == ["a/hooks.py:_before", "b/loop.py:my_step"]
