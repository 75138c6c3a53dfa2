"""The harness's layout, pinned: the process boundary in the tree, the launch behind one seam.

- ``ci/import_graph.py``'s rules hold: no import circle (so no import runs back up), only
  ``plugin.py`` imports ``harness/launched/``, nothing in ``harness/rank/`` imports the
  pytest side;
- loading the pytest side, and running a warm-rank session, loads no module of the launch
  but ``reports`` (whose early configure turns report files off on ranks other than 0);
- CONTRIBUTING lists every module.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def _import_graph() -> object:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "ci" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_import_rules_hold() -> None:
    graph: object = _import_graph()
    edges = graph.graph()  # type: ignore[attr-defined]
    assert graph.broken_rules(edges) == []  # type: ignore[attr-defined]
    assert "harness.launched.hooks" in edges["harness.plugin"]  # the one way in
    # The benchmarks are in it too (adopt.py and adopt_deepspeed.py imported each other).
    assert "benchmarks._common" in edges["benchmarks.adopt_deepspeed"]
    assert "benchmarks.adopt" not in edges["benchmarks.adopt_deepspeed"]


@pytest.mark.unit
def test_the_rules_catch_what_they_are_for() -> None:
    """The check itself: a circle, a module importing the launch, a rank importing runner or
    a warm module, a module both sides use importing either side, warm ranks reached past the
    seam, plan/ importing upwards, adoption or the pytest side imported from below."""
    graph: object = _import_graph()
    edges = {
        "harness.a": {"harness.b"},
        "harness.b": {"harness.a"},
        "harness.pytest_side.runner": {"harness.launched.session", "harness.warm.session"},
        "harness.plan.settings": {"harness.pytest_side.verdict", "harness.common.errors"},
        "harness.warm.preload": {"harness.adopt.core", "harness.plan.settings", "harness.seam"},
        "harness.adopt.spawn": {"harness.pytest_side.runner", "harness.seam"},
        "benchmarks.adopt": {"harness.warm.session", "harness.adopt.core"},
        "harness.rank.worker": {
            "harness.pytest_side.runner",
            "harness.warm.pools",
            "harness.common.x",
        },
        "harness.common.protocol": {"harness.rank.state", "harness.plan.settings"},
        "harness.rank.new_module": {"harness.warm.session"},
    }
    broken = graph.broken_rules(edges)  # type: ignore[attr-defined]
    assert "import circle: harness.a -> harness.b -> harness.a" in broken
    assert any("harness.pytest_side.runner imports harness.launched.session" in b for b in broken)
    assert any("harness.rank.worker imports harness.pytest_side.runner" in b for b in broken)
    assert any("harness.rank.worker imports harness.warm.pools" in b for b in broken)
    assert not any("harness.common.x" in b for b in broken)
    assert any("harness.common.protocol imports harness.rank.state" in b for b in broken)
    assert any("harness.common.protocol imports harness.plan.settings" in b for b in broken)
    assert any("harness.rank.new_module imports harness.warm.session" in b for b in broken)
    # Floors: warm ranks reached only through the seam, plan/ below every side, adoption
    # and the pytest side entered only from above.
    assert any("harness.pytest_side.runner imports harness.warm.session" in b for b in broken)
    assert any("harness.plan.settings imports harness.pytest_side.verdict" in b for b in broken)
    assert any("harness.warm.preload imports harness.adopt.core" in b for b in broken)
    fine = ("imports harness.common.errors", "imports harness.seam", "preload imports harness.plan")
    for allowed in (*fine, "harness.adopt.spawn imports", "benchmarks.adopt imports"):
        assert not any(allowed in b for b in broken), allowed


@pytest.mark.unit
def test_a_type_only_import_counts_for_a_circle(tmp_path: Path) -> None:
    graph: object = _import_graph()
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.b import X\n"
    )
    found = graph.imports_of("harness.a", module, {"harness.a", "harness.b"})  # type: ignore[attr-defined]
    assert found == {"harness.b"}


@pytest.mark.unit
def test_a_module_named_in_a_string_counts_as_imported(tmp_path: Path) -> None:
    """pytest_plugins, _LAZY and importlib.import_module load modules no import names."""
    graph: object = _import_graph()
    module = tmp_path / "m.py"
    module.write_text(
        "import importlib\n"
        "pytest_plugins = ['harness.b']\n"
        "_LAZY = {'X': 'harness.c'}\n"
        "importlib.import_module('harness.d')\n"
    )
    known = {"harness.a", "harness.b", "harness.c", "harness.d"}
    found = graph.imports_of("harness.a", module, known)  # type: ignore[attr-defined]
    assert found == {"harness.b", "harness.c", "harness.d"}
    edges = {"harness.common.x": {"harness"}, "harness.rank.y": {"harness"}}
    broken = graph.broken_rules(edges)  # type: ignore[attr-defined]
    assert len(broken) == 2, broken  # the package itself loads the pytest side


@pytest.mark.unit
def test_no_private_name_crosses_modules() -> None:
    graph: object = _import_graph()
    assert graph.private_imports() == []  # type: ignore[attr-defined]


@pytest.mark.unit
def test_the_private_name_check_catches_what_it_is_for(tmp_path: Path) -> None:
    graph: object = _import_graph()
    module = tmp_path / "m.py"
    module.write_text(
        "from rankwise import _wire\n"
        "from harness.rank.loader import _rewritten_code\n"
        "from harness.rank import worker\n"
        "from _pytest.outcomes import Failed\n"
        "worker._load_module('m', None)\n"
        "import harness.rank.worker\n"
        "harness.rank.worker._flush()\n"
        "import rankwise\n"
        "rankwise._wire.encode(1, 'x')\n"
    )
    found = graph._private_in("harness.adopt.ranks", module)  # type: ignore[attr-defined]
    assert len(found) == 6, found
    assert any("reads harness.rank.worker._flush" in f for f in found)
    assert any("reads rankwise._wire" in f for f in found)
    assert any("rankwise, another package's private" in f or "_wire" in f for f in found)
    assert any("reads harness.rank.worker._load_module" in f for f in found)


def _loaded_after(code: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", f"{code}; import sys; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return [m for m in eval(result.stdout.strip()) if m.startswith("harness.launched")]


def test_the_pytest_side_loads_no_module_of_the_launch() -> None:
    for module in (
        "harness.pytest_side.runner",
        "harness.plan.settings",
        "harness.warm.pools",
        "harness.seam",
    ):
        assert _loaded_after(f"import {module}") == [], module


def test_loading_the_plugin_imports_no_torch() -> None:
    """pytest imports the harness package and every module it lists in pytest_plugins when
    it loads the plugin: a session of plain tests (and an adopted suite's, whose fork server
    starts before the conftests so that its torch import overlaps theirs) must not pay
    torch's import there."""
    code = (
        "import importlib, sys, pytest, harness\n"
        "for name in harness.pytest_plugins: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout[:300]


def test_a_plain_session_imports_no_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import sys

def test_plain():
    assert "torch" not in sys.modules
"""
    )
    result = pytester.runpytest_subprocess("-p", "harness")
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_a_warm_session_never_enters_the_launch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
import sys

def pytest_sessionfinish(session):
    loaded = sorted(m for m in sys.modules if m.startswith("harness.launched"))
    print("LAUNCH MODULES", loaded)
"""
    )
    pytester.makepyfile(
        """
import pytest

@pytest.mark.ranks(2)
def test_ranks(rank, shared_tmp_path):
    assert rank in (0, 1)

def test_calls(run_on_ranks):
    assert run_on_ranks(abs, -1, world_size=2).values == [1, 1]
"""
    )
    result = pytester.runpytest_subprocess("-p", "harness", "-s")
    result.assert_outcomes(passed=2)
    assert "LAUNCH MODULES ['harness.launched', 'harness.launched.reports']" in result.stdout.str()


@pytest.mark.unit
def test_contributing_lists_every_module() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = text.split("## Architecture", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"^\s+([\w/]+\.py)\b", block, re.MULTILINE))
    for path in sorted((ROOT / "harness").rglob("*.py")):
        name = path.relative_to(ROOT / "harness").as_posix()
        assert name in listed, f"CONTRIBUTING's architecture does not list harness/{name}"


def _imported_by_a_test(module: str, tests: str) -> bool:
    """Whether the tests' text imports `module` (harness.x.y) or names it from its package."""
    package, _, short = module.rpartition(".")
    pattern = re.compile(
        rf"(import {re.escape(module)}\b|from {re.escape(module)} import|"
        rf"from {re.escape(package)} import [^\n]*\b{short}\b)"
    )
    return pattern.search(tests) is not None


@pytest.mark.unit
def test_every_module_is_imported_by_a_test_or_contributing_says_why_not() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("### Modules no test imports, and why", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([\w/]+\.py)`", section))
    modules = {
        path.relative_to(ROOT / "harness").as_posix(): "harness."
        + ".".join(path.relative_to(ROOT / "harness").with_suffix("").parts)
        for path in (ROOT / "harness").rglob("*.py")
        if path.name != "__init__.py"
    }
    listed &= set(modules)  # the section names test files too
    tests = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("*.py"))
    untested = {name for name, m in modules.items() if not _imported_by_a_test(m, tests)}
    assert untested <= listed, f"not imported by any test, nor in CONTRIBUTING: {untested - listed}"
    stale = {name for name in listed if name not in untested}
    assert not stale, f"CONTRIBUTING lists as untested, but a test imports them: {stale}"
