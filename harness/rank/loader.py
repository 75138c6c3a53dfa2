"""Finding a test's function inside a rank: its module imported as pytest imports it (a test
file compiled with pytest's assertion rewriting, pytest's own module names for
--import-mode=importlib and conftests), and the function or method a run's target names.

Runs only in ranks (the worker, and the rank side of adopted suites).
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.common import endings, pytest_internals
from harness.common.protocol import Target

endings.skip_frames_of(__file__)  # a failed import's traceback starts at the module's code


def load_test_module(target: Target) -> None:
    """Import `target`'s module as a test's run would (assertions rewritten), ahead of it:
    its own bound then times the body, not the import (see warm/session.py's
    import_ahead)."""
    finder.learn(target)
    load_module(target.module, target.file)  # by name where it has no test file


_loaded: dict[str, tuple[str, int]] = {}  # by module name: (file, mtime) loaded


def resolve(
    target: Target, instance_state: dict[str, Any] | None, class_state: dict[str, Any] | None
) -> Callable[..., Any]:
    """The test function (a test class's method on a new instance, with what setup_class and
    setup_method set) or run_on_ranks function `target` names."""
    module = load_module(target.module, target.file)
    holder: Any = module
    parts = target.qualname.split(".")
    for part in parts[:-1]:
        holder = getattr(holder, part)
    if isinstance(holder, type):
        for name, value in (class_state or {}).items():
            setattr(holder, name, value)  # what setup_class set in the pytest process
        holder = holder()  # a test class: pytest makes one instance per test too
        holder.__dict__.update(instance_state or {})  # what setup_method set on it
    fn = getattr(holder, parts[-1])
    if target.unwrap == "hypothesis":  # one example of a hypothesis test: its own function
        inner = fn.hypothesis.inner_test
        fn = types.MethodType(inner, holder) if inspect.ismethod(fn) else inner
    return fn  # type: ignore[no-any-return]


class _PytestsModules(importlib.abc.MetaPathFinder):
    """Finds, last of all finders, the modules pytest loaded under names sys.path cannot
    resolve (--import-mode=importlib, rootdir-relative packages): by the file pytest used."""

    def __init__(self) -> None:
        self._files: dict[str, str] = {}
        self._packages: dict[str, tuple[str, ...]] = {}

    def learn(self, target: Target) -> None:
        self._files.update(target.modules)
        self._packages.update(target.packages)
        if self not in sys.meta_path:
            sys.meta_path.append(self)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in self._files:
            loader = _RewritingLoader(self._files[name])
            return importlib.util.spec_from_file_location(name, self._files[name], loader=loader)
        if name in self._packages:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = list(self._packages[name])
            return spec  # a namespace package over pytest's paths
        return None


class _RewritingLoader(importlib.abc.Loader):
    """Executes a test or conftest file as pytest does: with its asserts rewritten."""

    def __init__(self, file: str) -> None:
        self._file = file

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        exec(_rewritten_code(self._file), module.__dict__)


finder = _PytestsModules()  # pytest's own module names, learnt from each run's target


def load_module(name: str, file: str | None) -> types.ModuleType:
    """Import the module `name`; a test file (`file`) is compiled with pytest's assertion
    rewriting, once per version of the file."""
    if file is None:
        return importlib.import_module(name)
    stamp = (file, os.stat(file).st_mtime_ns)
    if _loaded.get(name) == stamp and name in sys.modules:
        return sys.modules[name]
    code = _rewritten_code(file)
    module = types.ModuleType(name)
    module.__file__ = file
    module.__package__ = name.rpartition(".")[0]
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _loaded[name] = stamp
    return module


def _rewritten_code(file: str) -> types.CodeType:
    """`file` compiled as pytest compiles a test module: with its asserts rewritten."""
    source = Path(file).read_bytes()
    tree = ast.parse(source, filename=file)
    _rewrite_asserts(tree, source, file)
    return compile(tree, file, "exec", dont_inherit=True)


def _rewrite_asserts(tree: ast.Module, source: bytes, file: str) -> None:
    if pytest_internals.rewrite_asserts(tree, source, file):
        _install_explanations()


class _Verbosity:
    level = 0  # the running test's -v, for its asserts' diffs


def set_assert_verbosity(level: int) -> None:
    """pytest's -v for the running test: how much its failed asserts' diffs show."""
    _Verbosity.level = level


def _install_explanations() -> None:
    """Give rewritten asserts pytest's detailed comparisons ('At index 1 diff: 2 != 3').

    pytest wires these up per test in its own process; in a rank we call its comparison
    helper directly, adapting to the helper's signature, which differs between versions.
    """
    import inspect

    util: Any = pytest_internals.assertion_util()

    if util._reprcompare is not None:
        return
    params = inspect.signature(util.assertrepr_compare).parameters
    if "highlighter" in params:  # pytest >= 9

        def lines(op: str, left: object, right: object) -> Any:
            return util.assertrepr_compare(
                op,
                left,
                right,
                verbose=_Verbosity.level,
                highlighter=lambda source, lexer="python": source,
                assertion_text_diff_style="ndiff",
            )
    else:
        plain = types.SimpleNamespace(_highlight=lambda source, lexer="python": source)
        config = types.SimpleNamespace(
            get_verbosity=lambda *a: _Verbosity.level,
            getoption=lambda *a, **k: _Verbosity.level,
            getini=lambda *a: "",
            get_terminal_writer=lambda: plain,  # pytest 8's colour, none in a rank's text
        )

        def lines(op: str, left: object, right: object) -> Any:
            compare: Any = util.assertrepr_compare  # the pytest < 9 signature
            return compare(config, op, left, right)

    def explain(op: str, left: object, right: object) -> str | None:
        try:
            found = [line.replace("\n", "\\n") for line in lines(op, left, right) or ()]
        except Exception:
            return None
        return "\n~".join(found).replace("%", "%%") if found else None

    util._reprcompare = explain
