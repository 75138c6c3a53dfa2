"""A test packed for warm rank processes: where a rank finds its function, and the fixture
values, recipes, request and class state that travel with it (pickled, over the pool's
private pipes).

Loaded with the plugin; imports no torch.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import pytest

from harness.common import pytest_internals
from harness.common.errors import SpecError
from harness.common.protocol import (
    RANK_SIDE_FIXTURES,
    FixturePlan,
    FixtureRecipe,
    RequestInfo,
    Target,
    encode_args,
)
from harness.plan import made_in_ranks


def test_target(item: pytest.Function, unwrap: str = "") -> Target:
    """Where a rank finds the test function: its module, its file, its qualified name (and
    `unwrap`: "hypothesis" for a hypothesis test's inner function)."""
    module = item.module
    assert module is not None
    qualname = item.originalname
    if item.cls is not None:
        qualname = f"{item.cls.__qualname__}.{item.originalname}"
    modules, packages = test_modules(module)
    file = getattr(module, "__file__", None)
    return Target(module.__name__, file, qualname, modules, packages, unwrap)


Modules = tuple[tuple[tuple[str, str], ...], tuple[tuple[str, tuple[str, ...]], ...]]


def test_modules(test_module: object) -> Modules:
    """The test and conftest modules loaded here, and the packages above them, so a rank can
    import them by the names pytest gave them (with --import-mode=importlib, names that are
    not importable from sys.path). Computed again only when modules were imported since, or
    for another test module (an in-process pytester run may load as many, but others)."""
    key = (len(sys.modules), id(test_module))
    cached = _modules_cache.get(key)
    if cached is not None:
        return cached
    modules = {
        name: file
        for name, module in list(sys.modules.items())
        if isinstance(file := getattr(module, "__file__", None), str) and _is_test_file(file)
    }
    packages: dict[str, tuple[str, ...]] = {}
    for name in modules:
        parts = name.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            paths = getattr(sys.modules.get(parent), "__path__", None)
            if paths is not None:
                packages[parent] = tuple(str(p) for p in paths)
    found = (tuple(sorted(modules.items())), tuple(sorted(packages.items())))
    _modules_cache.clear()
    _modules_cache[key] = found
    return found


_modules_cache: dict[tuple[int, int], Modules] = {}  # by module count and test module


test_modules.__test__ = False  # type: ignore[attr-defined]  # not a test, despite its name


test_target.__test__ = False  # type: ignore[attr-defined]  # not a test, despite its name


def sendable_funcargs(item: pytest.Function, drawn: dict[str, Any] | None = None) -> bytes:
    """The test's arguments resolved here, encoded for the trip to the ranks.

    Fixtures the ranks make for themselves travel as what they are built from. A value that
    cannot travel fails the test naming its fixture; each value is pickled on its own only
    then, to find it. A test class instance's attributes (set by setup_method) travel too.
    """
    kwargs = {name: _sent_value(item, name) for name in item._fixtureinfo.argnames}
    kwargs.update(drawn or {})  # a hypothesis example's values
    state = dict(vars(item.instance)) if item.instance is not None else None
    fixtures = made_in_ranks.plan(item, lambda name, depth: _dependency(item, name, depth))
    class_state = class_changes(item.cls) if item.cls is not None else None
    try:
        return encode_args((), kwargs, state, fixtures, class_state)
    except Exception:
        pass  # found below, outside this handler: the report shows the message alone
    extra = fixtures.values if fixtures is not None else {}
    params = {r.name: r.param for r in _recipes(fixtures) if r.has_param}
    message = _unsendable(item, {**kwargs, **extra, **(state or {})}) or _unsendable(
        item, params, " (its param)"
    )
    if message is not None:
        pytest.fail(message, pytrace=False)
    return encode_args((), kwargs, state, fixtures, class_state)  # no one value: pickle's error


# Each rank test class's own attributes as collected: what a rank's import of it has.
_class_bodies: dict[int, tuple[type, dict[str, Any]]] = {}


def remember_class(cls: type) -> None:
    """Note `cls`'s attributes before any setup_class runs (at collection)."""
    if id(cls) not in _class_bodies:
        _class_bodies[id(cls)] = (cls, dict(vars(cls)))


def class_changes(cls: type) -> dict[str, Any] | None:
    """The attributes set on `cls` since it was collected (by setup_class, a class-scoped
    fixture) that can travel: a rank's own import of the class lacks them."""
    known = _class_bodies.get(id(cls))
    if known is None or known[0] is not cls:
        return None
    body = known[1]
    changed = {k: v for k, v in vars(cls).items() if k not in body or body[k] is not v}
    return {k: v for k, v in changed.items() if pickles(v)} or None


def _recipes(plan: FixturePlan | None) -> tuple[FixtureRecipe, ...]:
    return plan.recipes if plan is not None else ()


def _dependency(item: pytest.Function, name: str, depth: int) -> Any:
    """What a fixture made in the ranks is called with, from a fixture made here: at depth 1
    and beyond, the definition an override requests by its own name."""
    if depth == 0:
        return _sent_value(item, name)
    fixturedef = _definition(item, name, depth)
    return fixturedef.cached_result[0] if fixturedef.cached_result is not None else None


# pytest's fixtures bound to the pytest process itself (its reports, cache, config, files).
PYTEST_PROCESS_ONLY = (
    "pytestconfig",
    "cache",
    "record_property",
    "record_xml_attribute",
    "record_testsuite_property",
    "pytester",
    "testdir",
    "doctest_namespace",
    "capteesys",
)


def _sent_value(item: pytest.Function, name: str) -> Any:
    if name in PYTEST_PROCESS_ONLY:
        pytest.fail(
            f"fixture {name!r} of {item.nodeid} lives in the pytest process and cannot be used "
            f"inside ranks: use it in a test without @pytest.mark.ranks (run_on_ranks returns "
            f"each rank's value to record there)",
            pytrace=False,
        )
    if name == "request":
        return request_info(item)
    if name in ("tmp_path", "tmpdir"):
        return str(item.funcargs[name])  # each rank makes its own directory below it
    if name == "caplog":  # the level pytest captures at (--log-level, ini log_level)
        return pytest_internals.log_level(item.config, "log_level")
    if name in RANK_SIDE_FIXTURES and made_in_ranks.is_builtin(_definition(item, name)):
        return None  # the rank makes its own
    return item.funcargs[name]  # a project's own fixture, even one named `device`


def _definition(item: pytest.Function, name: str, depth: int = 0) -> Any:
    """The fixture definition `name` means for `item` (depth 0), or the one an override at
    depth - 1 requests by its own name; None where pytest has none (a pseudo-fixture)."""
    chain = item._fixtureinfo.name2fixturedefs.get(name, ())
    return chain[-1 - depth] if depth < len(chain) else None


def request_info(item: pytest.Function) -> RequestInfo:
    """What the test's ``request`` can tell a rank, as far as it can travel."""
    request: Any = item._request
    config = item.config
    inis = {name: _ini(config, name) for name in config._parser._inidict}
    return RequestInfo(
        name=item.name,
        nodeid=item.nodeid,
        keywords=tuple(item.keywords),
        markers=tuple(_mark_that_travels(m) for m in item.iter_markers()),
        fixturenames=tuple(item.fixturenames),
        options=_picklable_once(config, "options", vars(config.option)),
        ini=_picklable_once(config, "ini", inis),
        has_param=hasattr(request, "param"),
        param=getattr(request, "param", None),
        flags=_picklable_once(config, "flags", pytest_internals.option_flags(config)),
        path=str(item.path),
    )


def _ini(config: pytest.Config, name: str) -> Any:
    try:
        return config.getini(name)
    except Exception:
        return None


def _mark_that_travels(mark: pytest.Mark) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    args = tuple(a if pickles(a) else repr(a) for a in mark.args)
    kwargs = {k: v if pickles(v) else repr(v) for k, v in mark.kwargs.items()}
    return mark.name, args, kwargs


def _picklable(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items() if pickles(value)}


_travelling_key = pytest.StashKey[dict[str, tuple[dict[str, Any], dict[str, Any]]]]()


def _picklable_once(config: pytest.Config, kind: str, values: dict[str, Any]) -> dict[str, Any]:
    """_picklable(values), found again only when a value changed: the session's options and
    ini values are the same for every test, and each is pickled to find out."""
    cache = config.stash.setdefault(_travelling_key, {})
    seen, found = cache.get(kind, (None, {}))
    try:
        same = seen == values
    except Exception:  # a value that cannot say whether it equals another
        same = False
    if not same:
        found = _picklable(values)
        cache[kind] = (dict(values), found)
    return found


def pickles(value: Any) -> bool:
    """Whether `value` pickles (it can travel to a rank)."""
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _unsendable(item: pytest.Function, values: dict[str, Any], what: str = "") -> str | None:
    """The message naming the first of `values` (by fixture name) that cannot be pickled."""
    for name, value in values.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            return (
                f"fixture {name!r}{what} of {item.nodeid} cannot be sent to the ranks "
                f"({type(exc).__name__}: {exc}); make its value picklable, or build it "
                f"inside the test body"
            )
    return None


def function_target(fn: Callable[..., Any]) -> Target:
    """Where a rank finds `fn`; ValueError for a function it cannot find by name."""
    qualname = getattr(fn, "__qualname__", "")
    module_name = getattr(fn, "__module__", None)
    if not module_name or not qualname or "<" in qualname:
        raise SpecError(
            f"run_on_ranks needs a module-level function (found by name in each rank), "
            f"not {fn!r}; move it to the top level of a module"
        )
    file = getattr(sys.modules.get(module_name), "__file__", None)
    # A test module (assertion-rewritten here) is loaded the same way in the ranks.
    return Target(module_name, file if file is not None and _is_test_file(file) else None, qualname)


def _is_test_file(file: str) -> bool:
    name = os.path.basename(file)  # string work: called for every loaded module
    return name.startswith(("test_", "conftest")) or name.endswith("_test.py")
