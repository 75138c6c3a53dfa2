"""The harness's import graph, and the rules its layout keeps (run by tests/test_layout.py).

Every import counts, a function's and a type checker's (``if TYPE_CHECKING:``) too, and so
does a module named in a string: in ``pytest_plugins``, ``_LAZY``, or as the literal argument
of ``importlib.import_module``, ``importlib.util.find_spec`` or ``sys.modules.get``. Rules,
by folder, so that a new module is held to them by where it lies:
- no import circle, so no import runs back up: a module never (even transitively, even
  from inside a function, even for types) imports one that imports it;
- ``harness/common/`` (used by the pytest process and by the ranks) imports nothing of the
  harness outside ``harness/common/``;
- ``harness/rank/`` (runs only inside a rank) imports only ``harness/rank/`` and
  ``harness/common/``: a rank runs tests, the pytest process judges them;
- nothing outside ``harness/launched/`` imports it but ``plugin.py`` (and the package's
  ``pytest_plugins`` list, which names ``launched.reports``: its early configure);
- nothing outside ``harness/warm/`` imports it but ``plugin.py``, which puts warm ranks in
  place: the rest reaches ranks through ``seam.py`` (``Ranks``, ``OwnRanks``);
- ``harness/plan/`` (what the pytest side, warm ranks and a launch all read) imports only
  ``harness/plan/`` and ``harness/common/``;
- ``harness/adopt/`` is imported only by the package, ``plugin.py`` and ``hookspecs.py``;
  ``harness/pytest_side/`` only by those and ``harness/adopt/`` (nothing below them: warm,
  launched, plan, rank, common);
- no module of ``harness/``, ``lib/`` or ``benchmarks/`` imports another module's private
  name (``_x``), or a private module of another package (``rankwise._wire`` from the
  harness); a package's own private modules are its own (``rankwise._launch`` from
  ``rankwise._plan``, ``benchmarks._common`` from ``benchmarks.adopt``).

The benchmarks are in the graph too: no circle among them either.

``python ci/import_graph.py`` prints the graph's edges and any broken rule (exit status 1).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harness"
SOURCES = (ROOT / "harness", ROOT / "lib" / "rankwise", ROOT / "benchmarks")
COMMON = "harness.common"  # both processes
RANK_SIDE = "harness.rank"  # inside a rank only
LAUNCH = "harness.launched"  # pytest under torchrun, entered through plugin.py alone
PLAN = "harness.plan"  # read by every side above common/: imports only plan/ and common/
# Packages that only these modules outside them may import (besides the benchmarks).
ONLY_FROM = {
    "harness.warm": ("harness.plugin",),
    "harness.adopt": ("harness", "harness.plugin", "harness.hookspecs"),
    "harness.pytest_side": ("harness", "harness.plugin", "harness.adopt"),
}
PYTEST_INTERNALS = "harness.common.pytest_internals"  # the one module that reads _pytest
# The ways into harness/launched/: plugin.py registers its hooks under a launch; the
# package's pytest_plugins names launched.reports (its early configure imports no torch).
LAUNCH_ENTRIES = {
    ("harness.plugin", "harness.launched"),
    ("harness.plugin", "harness.launched.hooks"),
    ("harness", "harness.launched.reports"),
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of `package` by dotted name."""
    found = {}
    top = package.parent
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(top).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The harness modules `name` imports, wherever the import stands, named in code or in
    a string that loads a module."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = {_known(s, known) for s in _named_in_strings(tree)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                found.add(whole if whole in known else _known(base, known))
    found.discard("")
    found.discard(name)
    return found


_LOADERS = ("import_module", "find_spec", "get")  # importlib's, and sys.modules.get


def _named_in_strings(tree: ast.AST) -> list[str]:
    """Module names that load a module though no import statement names them: the strings
    of pytest_plugins and _LAZY, and literal arguments of importlib.import_module,
    importlib.util.find_spec and sys.modules.get."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("pytest_plugins", "_LAZY") for t in node.targets
        ):
            found += [c.value for c in ast.walk(node.value) if _is_module_string(c)]
        elif _loads_a_named_module(node):
            found.append(node.args[0].value)  # type: ignore[attr-defined]
    return found


def _loads_a_named_module(node: ast.AST) -> bool:
    """importlib.import_module("harness.x") and the like: a call loading a module by name."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _LOADERS
        and bool(node.args)
        and _is_module_string(node.args[0])
    )


def _is_module_string(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.split(".")[0] in ("harness", "rankwise", "benchmarks")
    )


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _known(name: str, known: set[str]) -> str:
    """The harness module `name` is, or its nearest harness package; "" outside harness."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def graph() -> dict[str, set[str]]:
    """The harness's and the benchmarks' modules, and which of them each imports."""
    found = modules() | modules(ROOT / "benchmarks")
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each once (as found by a depth-first walk)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node)
    return found


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _is_package(name: str) -> bool:
    """A package's __init__ (harness, harness.rank, ...): its rule is in its docstring."""
    return (ROOT / Path(*name.split(".")) / "__init__.py").exists()


def broken_rules(edges: dict[str, set[str]]) -> list[str]:
    broken = [f"import circle: {' -> '.join(c)}" for c in cycles(edges)]
    for name, targets in sorted(edges.items()):
        for target in sorted(targets):
            into_launch = _inside(target, LAUNCH) and not _inside(name, LAUNCH)
            if into_launch and (name, target) not in LAUNCH_ENTRIES:
                broken.append(f"{name} imports {target}: only plugin.py may import the launch")
            if _inside(name, COMMON) and not _inside(target, COMMON):
                broken.append(
                    f"{name} imports {target}: harness/common/ imports nothing outside it"
                )
            broken += _floor_rules(name, target)
            allowed = _inside(target, RANK_SIDE) or _inside(target, COMMON)
            if _inside(name, RANK_SIDE) and not allowed:
                broken.append(
                    f"{name} imports {target}: harness/rank/ imports only harness/rank/ and "
                    f"harness/common/ (the rank side imports no pytest side)"
                )
    return broken


def _floor_rules(name: str, target: str) -> list[str]:
    """What `name` importing `target` breaks of plan/'s floor and the packages entered only
    from above (ONLY_FROM)."""
    broken = []
    if _inside(name, PLAN) and not (_inside(target, PLAN) or _inside(target, COMMON)):
        broken.append(f"{name} imports {target}: harness/plan/ imports only plan/ and common/")
    for package, entries in ONLY_FROM.items():
        outside = _inside(target, package) and not _inside(name, package)
        entered = any(name == e or (e != "harness" and _inside(name, e)) for e in entries)
        if outside and not name.startswith("benchmarks") and not entered:
            broken.append(
                f"{name} imports {target}: only {', '.join(entries)} may import "
                f"{package.replace('.', '/')}/"
            )
    return broken


def private_imports() -> list[str]:
    """Each place a module of harness/ or lib/ imports another module's private name, or a
    private module of another package."""
    found: list[str] = []
    for source in SOURCES:
        for name, path in modules(source).items():
            found += _private_in(name, path)
    return found


def _private_in(name: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = _private_attributes(tree, package, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            names = [alias.name for alias in node.names]
            found += [f"{where}:{node.lineno} {why}" for why in _from_import(name, base, names)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                why = _plain_import(name, alias.name)
                found += [f"{where}:{node.lineno} {why}"] if why else []
    return found


def _from_import(name: str, base: str, names: list[str]) -> list[str]:
    """Why `from base import names` in module `name` breaks the rule (empty: it does not)."""
    top, base_top = name.split(".")[0], base.split(".")[0]
    if base_top == "_pytest":
        return [] if name == PYTEST_INTERNALS else [f"imports {base}: pytest's private modules"]
    if base_top not in ("harness", "rankwise"):
        return []
    foreign = base_top != top
    found = []
    if foreign and any(part.startswith("_") for part in base.split(".")[1:]):
        found.append(f"imports {base}, another package's private module")
    own_modules = _MODULE_NAMES.get(top, set())
    for alias in names:
        private = alias.startswith("_") and not alias.startswith("__")
        if private and (foreign or f"{base}.{alias}" not in own_modules):
            found.append(f"imports {alias} from {base}")
    return found


def _plain_import(name: str, imported: str) -> str:
    """Why `import imported` in module `name` breaks the rule ("": it does not)."""
    parts = imported.split(".")
    if parts[0] == "_pytest" and name != PYTEST_INTERNALS:
        return f"imports {imported}: pytest's private modules"
    foreign = parts[0] in ("harness", "rankwise") and parts[0] != name.split(".")[0]
    if foreign and any(part.startswith("_") for part in parts[1:]):
        return f"imports {imported}, another package's private module"
    return ""


def _private_attributes(tree: ast.AST, package: str, where: Path) -> list[str]:
    """`module._name` where `module` is a harness or rankwise module this file imported,
    by a name of its own (`from harness.rank import worker`) or dotted
    (`harness.rank.worker._name` after `import harness.rank.worker`)."""
    known = _MODULE_NAMES["harness"] | _MODULE_NAMES["rankwise"]
    bound: dict[str, str] = {}  # a local name -> the module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in ("harness", "rankwise"):  # `import a.b as c` binds c to a.b, else a
                    bound[a.asname or top] = a.name if a.asname else top
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        module = _dotted_module(node.value, bound)
        if module is not None and module in known:
            found.append(f"{where}:{node.lineno} reads {module}.{node.attr}, a private name")
    return found


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _dotted_module(node: ast.AST, bound: dict[str, str]) -> str | None:
    """The module a chain like `harness.rank.worker` or `worker` names, if its root is an
    imported name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    return ".".join([bound[node.id], *parts])


_MODULE_NAMES = {
    "harness": set(modules(PACKAGE)),
    "rankwise": set(modules(ROOT / "lib" / "rankwise")),
    "benchmarks": set(modules(ROOT / "benchmarks")),
}


def main() -> int:
    edges = graph()
    for name, targets in sorted(edges.items()):
        print(f"{name} -> {', '.join(sorted(targets)) or '(nothing)'}")
    broken = broken_rules(edges) + private_imports()
    for line in broken:
        print(f"BROKEN: {line}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
