"""The package's shape, as the house rules state it: an acyclic import graph (function-level imports and
``importlib.import_module("...")`` included), no function longer than 80 lines, a Session that only
assembles. Read from the source with :mod:`ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


@pytest.mark.slow
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
    lines = len((PACKAGE / "training" / "run" / "session.py").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_SESSION_LINES, (
        f"training/run/session.py has {lines} lines (at most {MAX_SESSION_LINES})"
    )


#: Where a rule's step hooks are called: the step sequence itself, and a rule delegating to the rule it wraps.
STEP_SEQUENCE = "mpicrossbow/training/run/step.py"


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
    outside training/run/step.py, or a pool's ``apply`` together with a rule's ``exchange``. A rule's own
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


@pytest.mark.slow
def test_train_step_is_the_only_place_the_step_sequence_is_written() -> None:
    """Whoever drives a pool and a rule (the loop, the embedded API's hooks, tests, MPI scripts, benchmarks)
    goes through training/run/step.py (``train_step``, or ``rule_gradients``/``rule_exchange`` around a
    user's own optimizer step): no second copy of the sequence anywhere."""
    sources = {
        str(path.relative_to(REPO)): path.read_text(encoding="utf-8")
        for folder in ("mpicrossbow", "tests", "benchmarks", "examples")
        for path in sorted((REPO / folder).rglob("*.py"))
    }
    assert sequence_writers(sources) == []


def test_a_second_copy_of_the_step_sequence_fails_the_structure_test() -> None:
    """The embedded hooks as they were before they called training/run/step.py, and a loop of one's own."""
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


# One name per concept (issue 41): no two public classes or modules share a name or differ only by an
# inflection or a suffix unless they are one concept, and no subpackage's public name shadows another's.

#: Module stems every package may have, each the same concept in each package: the package file, its
#: interface (``base``: comm's Communicator, pool's LearnerPool, rules' Rule), its table of named
#: implementations (``registry``: the generic Registry and the data sets' and rules' tables) and a console
#: script's command line (``cli``: crossbow-launch's, crossbow-report's).
SHARED_STEMS = frozenset({"__init__", "base", "registry", "cli"})

#: Public module-level names any module may define, each the same thing wherever it is: the module's logger,
#: a ``python -m`` module's entry point, the ``torch.Tensor`` shorthand.
SHARED_NAMES = frozenset({"log", "logger", "main", "T"})

#: Near-names that are distinct concepts, and why each is one.
DISTINCT_NEAR_NAMES = {
    # pool/: the Replicated value (every replica's tensor stacked, seen as one), the fused path that runs a
    # network's own forward on it, and the handlers that run each torch operator on it: three parts, three
    # files.
    frozenset({"replicated", "replicated_network"}): "the value; the network path built on it",
    frozenset({"replicated", "replicated_ops"}): "the value; its per-operator handlers",
    # rules/: the SMA rule, and the stability analysis that picks its elastic rate α (pure arithmetic).
    frozenset({"sma", "sma_stability"}): "the rule; the analysis of where it is stable",
    # rules/: the EASGD rule, and its asynchronous mode's wire protocol (the centre's server loop, a worker's
    # exchange with it), named for EASGD so that "elastic" means elastic training alone.
    frozenset({"easgd", "easgd_server"}): "the rule; its asynchronous centre's server and worker protocol",
    # model.shard.Shard is a rank's share of a data set's rows (the model contract); data.shards.Shards is the
    # packed-HDF5 image data set (``[data] dataset = shards``). Both are user API, named in model files and
    # cfgs, so they keep their names.
    frozenset({"shard", "shards"}): "a rank's share of rows; the packed image data set",
}

#: Endings that make an inflection of the same word (a plural, a gerund, an agent, an action).
INFLECTIONS = ("ings", "ing", "ions", "ion", "ers", "er", "es", "ed", "s", "d")


def stems_of(name: str) -> set[str]:
    """``name`` lower-cased, and with each inflection it ends in taken off (``checkpointing`` →
    ``checkpoint``)."""
    low = name.lower()
    return {low} | {low[: -len(end)] for end in INFLECTIONS if low.endswith(end) and len(low) - len(end) >= 3}


def near(a: str, b: str) -> bool:
    """Whether two names are equal or the same word inflected: Recorder/Recorder, Shard/Shards,
    Replicated/Replication, checkpoint/checkpointing."""
    return bool(stems_of(a) & stems_of(b))


def distinct(a: str, b: str) -> bool:
    return frozenset({a.lower(), b.lower()}) in DISTINCT_NEAR_NAMES


def near_pairs(named: list[tuple[str, str]]) -> list[str]:
    """``(where, name)`` pairs at two places whose names are equal or near, not allow-listed as distinct."""
    found = []
    for i, (where_a, a) in enumerate(named):
        for where_b, b in named[i + 1 :]:
            if (where_a, a) != (where_b, b) and near(a, b) and not distinct(a, b):
                found.append(f"{where_a}.{a} ~ {where_b}.{b}")
    return found


def suffixed_pairs(stems: list[tuple[str, str]]) -> list[str]:
    """Within one package, a module named after another plus ``_suffix`` (``snapshots`` and
    ``snapshot_orders``), not allow-listed as distinct."""
    found = []
    for package, a in stems:
        for other, b in stems:
            if package == other and a != b and not distinct(a, b):
                if any(b.startswith(f"{s}_") for s in stems_of(a)):
                    found.append(f"{package}.{a} ~ {package}.{b}")
    return found


def shadowing(names: list[tuple[str, str]]) -> list[str]:
    """Public module-level names defined in modules of two different subpackages (pool's ``RULES`` beside
    the exchange rules' ``RULES``)."""
    packages: dict[str, set[str]] = {}
    where: dict[str, list[str]] = {}
    for module, name in names:
        if name not in SHARED_NAMES:
            packages.setdefault(name, set()).add(module.rpartition(".")[0])
            where.setdefault(name, []).append(module)
    return [f"{name}: {', '.join(where[name])}" for name, found in sorted(packages.items()) if len(found) > 1]


def top_level(path: Path) -> list[tuple[str, bool]]:
    """``(name, is_class)`` for every public name ``path`` defines at module level."""
    found = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((node.name, isinstance(node, ast.ClassDef)))
        elif isinstance(node, ast.Assign):
            found += [(t.id, False) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.append((node.target.id, False))
    return [(name, is_class) for name, is_class in found if not name.startswith("_")]


def package_names() -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """The package's public classes and module-level names as ``(module, name)``, and its modules as
    ``(package, stem)``."""
    classes, names, stems = [], [], []
    for module, path in modules().items():
        for name, is_class in top_level(path):
            names.append((module, name))
            if is_class:
                classes.append((module, name))
        stems.append((module_name(path.parent) if path.stem != "__init__" else module, path.stem))
    return classes, names, stems


def test_one_name_per_concept() -> None:
    classes, names, stems = package_names()
    assert near_pairs(classes) == [], "public classes that share a name or differ only by an inflection"
    modules_ = [(package, stem) for package, stem in stems if stem not in SHARED_STEMS]
    assert near_pairs(modules_) == [], "modules that share a name or differ only by an inflection"
    assert suffixed_pairs(modules_) == [], "modules named after another module plus a suffix"
    assert shadowing(names) == [], "public names one subpackage defines that another defines too"


def test_a_second_name_for_a_concept_fails_the_structure_test() -> None:
    """The checks above flag what issue 41 found, fed as synthetic names."""
    assert near_pairs([("mpicrossbow.trace", "Recorder"), ("mpicrossbow.pool.fused.replay", "Recorder")])
    assert near_pairs(
        [
            ("mpicrossbow.pool.fused.replicated", "Replicated"),
            ("mpicrossbow.pool.fused.replicated", "Replication"),
        ]
    )
    assert near_pairs([("mpicrossbow.training", "checkpoint"), ("mpicrossbow.training", "checkpointing")])
    assert near_pairs([("mpicrossbow.pool", "replicas"), ("mpicrossbow.training", "replicas")])
    assert suffixed_pairs(
        [("mpicrossbow.training", "snapshots"), ("mpicrossbow.training", "snapshot_orders")]
    )
    assert suffixed_pairs(
        [("mpicrossbow.training", "checkpoint"), ("mpicrossbow.training", "checkpoint_lock")]
    )
    assert shadowing(
        [("mpicrossbow.pool.fused.replicated_ops", "RULES"), ("mpicrossbow.rules.registry", "RULES")]
    )
    # ... and pass what is one concept, or allow-listed as two.
    assert not near_pairs([("mpicrossbow.pool", "fused_pool"), ("mpicrossbow.pool", "fused_network")])
    assert not suffixed_pairs([("mpicrossbow.rules", "sma"), ("mpicrossbow.rules", "sma_stability")])
    assert not shadowing([("mpicrossbow.pool.fused.fused_pool", "log"), ("mpicrossbow.rules.bsp", "log")])


#: The modules that define what a lost rank is and how a run survives one: importing any of them is knowing
#: that the communicator can fail.
FAILURE_MODULES = ("mpicrossbow.comm.ulfm", "mpicrossbow.comm.elastic")
FAILURE_PACKAGES = ("mpicrossbow.training.elastic", "mpicrossbow.testing.fault_double")

#: Every module that knows the communicator can fail (issue 50: one owner, the rest unaware), outside the
#: rules' ``on_rebind`` methods. A new entry is a new place to change when fault tolerance changes: put the
#: knowledge in the owner (FaultTolerance) or the communicator instead, or add it here with its reason.
KNOWS_FAILURE = {
    # the communicator's side: what a lost rank is, the elastic communicator, the one retry primitive
    "mpicrossbow.comm.ulfm": "ULFM's errors as PeerLost and ElasticEnd",
    "mpicrossbow.comm.elastic": "notices a loss, commits, recovers (and the retry primitive over them, "
    "until_committed): swaps the communicator under the rules",
    # the owner and what it delegates to
    "mpicrossbow.training.elastic.fault_tolerance": "the one owner: windows, restore, membership changes",
    "mpicrossbow.training.elastic.run_tolerance": "the owner in a crossbow-launch run; whether one is built",
    "mpicrossbow.training.elastic.elastic_pause": "asynchronous snapshots met over the survivors",
    "mpicrossbow.training.elastic.replacement": "a replacement's spawn, merge and handover",
    # who builds the owner, and who ends a rank of an elastic run alone
    "mpicrossbow.training.run.session": "builds the elastic communicator and the owner, once",
    "mpicrossbow.training.run.runner": "a failing elastic rank leaves alone; a replacement's life",
    # asynchronous rules forget a lost peer where they meet it, between steps (no window to commit); GSP's
    # worker groups commit on their own
    "mpicrossbow.rules.peer_loss": "an asynchronous rule's side of a lost peer: forget it, or end the job",
    "mpicrossbow.rules.gsp": "each worker group commits and recovers on its own (split_apart)",
    # the embedded API's elastic mode: its checks, and the owner built around the user's optimizer step
    "mpicrossbow.embed.elastic_mode": "xb.init(elastic=True): ULFM checked, the owner built over the model",
    # the test double of a fault-tolerant group, shipped for users' own rule tests
    "mpicrossbow.testing.fault_double": "ranks as threads that die on demand (ULFM's semantics)",
}


def failure_names(path: Path) -> set[str]:
    """The names ``path`` imports from the failure modules (what its code can mention)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and "ulfm" in node.module:
            names.update(a.asname or a.name for a in node.names)
    return names


def only_in_on_rebind(path: Path, names: set[str]) -> bool:
    """Whether every mention of ``names`` in ``path`` is inside a method named ``on_rebind``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "on_rebind":
            inside.update(id(n) for n in ast.walk(node))
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in names]
    return bool(uses) and all(id(n) in inside for n in uses)


def bare(path: Path) -> bool:
    """Whether a module holds nothing but its docstring (a package's ``__init__`` that only names it)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def modules_that_know_failure() -> set[str]:
    """The failure modules and packages' modules, and every module that imports one (a rule's import used
    only in its ``on_rebind`` aside); a failure package whose ``__init__`` is its docstring alone knows
    nothing itself."""
    known = modules()
    failure = {
        name
        for name in known
        if name in FAILURE_MODULES or any(name == p or name.startswith(p + ".") for p in FAILURE_PACKAGES)
    }
    knowing = {name for name in failure if not bare(known[name])}
    for name, path in known.items():
        if not imported(path, known) & failure:
            continue
        if name.startswith("mpicrossbow.rules.") and only_in_on_rebind(path, failure_names(path)):
            continue  # a rule's on_rebind: where it drops what it had in flight on the lost world
        knowing.add(name)
    return knowing


def test_fault_tolerance_is_known_in_the_listed_modules_only() -> None:
    """The modules that know the communicator can fail are exactly the list, each with its reason (SMA's
    ``on_rebind`` is the rules' own place and is left out)."""
    assert modules_that_know_failure() == set(KNOWS_FAILURE)
    assert len(KNOWS_FAILURE) <= 12  # issue 50's bound: a new place to change needs another to go


#: The most modules one folder of training/ holds (issue 50: "training/ has no flat list of more than 15
#: modules"): a folder past it is a concern to split out, as health/, checkpoints/ and reporting/ were.
MAX_MODULES_PER_FOLDER = 15


def test_no_folder_of_training_lists_more_than_15_modules() -> None:
    """training/ is split by concern; no sub-package (nor training/ itself) holds more than 15 modules
    besides its ``__init__.py``."""
    training = PACKAGE / "training"
    folders = [training, *[d for d in training.iterdir() if (d / "__init__.py").exists()]]
    counts = {
        str(f.relative_to(PACKAGE)): len([m for m in f.glob("*.py") if m.name != "__init__.py"])
        for f in folders
    }
    assert len(counts) > 5 and counts["training/run"] > 1  # it read the folders
    assert {f: n for f, n in counts.items() if n > MAX_MODULES_PER_FOLDER} == {}
