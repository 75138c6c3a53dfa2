"""The harness's import graph, and the rules its layout keeps (run by tests/test_layout.py).

Every import that runs counts, a function's too (those under ``if TYPE_CHECKING:`` do not).
Rules:
- no import circle, so no import runs back up: a module never (even transitively, even
  from inside a function) imports one that imports it;
- nothing outside ``harness/launched/`` imports it but ``plugin.py``;
- nothing in ``harness/rank/`` imports the pytest side: a rank runs tests, the pytest
  process judges them.

``python ci/import_graph.py`` prints the graph's edges and any broken rule (exit status 1).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harness"
# The modules that run in the pytest process only (the rank side may import none of them).
PYTEST_SIDE = (
    "harness.plugin",
    "harness.runner",
    "harness.ranks",
    "harness.packing",
    "harness.settings",
    "harness.warm.pool",
    "harness.spawning",
    "harness.adopt",
    "harness.made_in_ranks",
    "harness.simulate",
    "harness.launched",
)


def modules() -> dict[str, Path]:
    """Every harness module by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The harness modules `name` imports when it runs (TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _running(tree):
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


def _running(tree: ast.AST) -> list[ast.AST]:
    """The nodes of `tree` outside `if TYPE_CHECKING:` blocks."""
    kept: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        kept.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return kept


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
    found = modules()
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


def broken_rules(edges: dict[str, set[str]]) -> list[str]:
    broken = [f"import circle: {' -> '.join(c)}" for c in cycles(edges)]
    for name, targets in sorted(edges.items()):
        for target in sorted(targets):
            launched = _inside(target, "harness.launched") and not _inside(name, "harness.launched")
            if launched and name != "harness.plugin":
                broken.append(f"{name} imports {target}: only plugin.py may import the launch")
            pytest_side = any(_inside(target, side) for side in PYTEST_SIDE)
            if _inside(name, "harness.rank") and pytest_side:
                broken.append(f"{name} imports {target}: the rank side imports no pytest side")
    return broken


def main() -> int:
    edges = graph()
    for name, targets in sorted(edges.items()):
        print(f"{name} -> {', '.join(sorted(targets)) or '(nothing)'}")
    broken = broken_rules(edges)
    for line in broken:
        print(f"BROKEN: {line}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
