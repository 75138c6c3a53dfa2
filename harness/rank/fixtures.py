"""pytest's fixtures made inside a rank: each rank gets its own, undone in the rank.

``capsys``/``capfd`` (and their binary forms) capture this rank's output, ``caplog`` its log
records, ``recwarn`` its warnings, ``monkeypatch`` patches and undoes here, ``tmp_path`` and
``tmpdir`` are this rank's own directory, and ``request`` is a snapshot of the pytest-side
request (node, markers, parameters, options) whose ``addfinalizer`` runs in the rank. The
test's own fixtures that use any of these (see ``harness.plan.made_in_ranks``) are called here too,
from the recipes the pytest process sent. Runs inside ranks; imports pytest, not torch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import os
import sys
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.common import endings, pytest_internals
from harness.common.protocol import RANK_SIDE_FIXTURES, FixturePlan, FixtureRecipe, RequestInfo

endings.skip_frames_of(__file__)  # a fixture's traceback starts at its own function


class RankNode:
    """What a test's node tells a rank: names, keywords and markers."""

    def __init__(self, info: RequestInfo) -> None:
        self.name = info.name
        self.nodeid = info.nodeid
        self.keywords = dict.fromkeys(info.keywords, True)
        self.own_markers = [pytest.Mark(n, a, k, _ispytest=True) for n, a, k in info.markers]

    def iter_markers(self, name: str | None = None) -> Iterator[pytest.Mark]:
        return (m for m in self.own_markers if name is None or m.name == name)

    def get_closest_marker(self, name: str, default: Any = None) -> Any:
        return next(self.iter_markers(name), default)

    def __repr__(self) -> str:
        return f"<RankNode {self.nodeid}>"


# Loads a module from its file under a given name: (name, file) -> the module.
LoadModule = Callable[[str, str], types.ModuleType]
_UNSET = object()  # getoption without a default: an unknown option raises, as in pytest


class RankConfig:
    """The pytest process's option and ini values, as they were when the test ran."""

    def __init__(self, info: RequestInfo) -> None:
        self._options = info.options
        self._ini = info.ini
        self._flags = info.flags

    def getoption(self, name: str, default: Any = _UNSET, skip: bool = False) -> Any:
        """An option by its name or its flag ("--big"), as pytest's config.getoption."""
        key = self._flags.get(name, name)
        if key in self._options:
            return self._options[key]
        if skip:
            pytest.skip(f"no {name!r} option found")
        if default is not _UNSET:
            return default
        raise ValueError(f"no option named {name!r} (or its value could not reach the rank)")

    def getini(self, name: str) -> Any:
        if name not in self._ini:
            raise ValueError(f"unknown ini key {name!r} (or its value could not travel)")
        return self._ini[name]


class RankRequest:
    """The test's ``request`` inside a rank; ``addfinalizer`` runs there after the test. A
    fixture the rank makes gets a copy naming it, with its own ``param``."""

    def __init__(self, info: RequestInfo, on_teardown: Callable[[Callable[[], object]], Any]):
        self.node = RankNode(info)
        self.config = RankConfig(info)
        self.fixturenames = list(info.fixturenames)
        self.keywords = self.node.keywords
        self.fixturename: str | None = None
        self.scope = "function"  # a rank makes its fixtures for each test
        self.path = Path(info.path)
        self.function: Any = None  # the test's, once bound (see bind)
        self.instance: Any = None
        self.cls: type | None = None
        self.module: types.ModuleType | None = None
        self._param, self._has_param = info.param, info.has_param
        self._on_teardown = on_teardown

    def bind(self, test: Callable[..., Any]) -> None:
        """Name the test function as this rank loaded it (a method bound to its instance)."""
        self.instance = getattr(test, "__self__", None)
        self.function = getattr(test, "__func__", test)
        self.cls = type(self.instance) if self.instance is not None else None
        self.module = sys.modules.get(getattr(self.function, "__module__", ""))

    @property
    def param(self) -> Any:
        if not self._has_param:
            raise AttributeError(f"'request' of {self._whose()} has no 'param'")
        return self._param

    def addfinalizer(self, finalizer: Callable[[], object]) -> None:
        self._on_teardown(finalizer)

    def getfixturevalue(self, name: str) -> Any:
        raise pytest.UsageError(
            f"request.getfixturevalue({name!r}) cannot make a fixture inside a rank: ask for "
            f"{name!r} as an argument of the test (or of the fixture)"
        )

    def for_fixture(self, recipe: FixtureRecipe) -> RankRequest:
        view = copy.copy(self)
        view.fixturename = recipe.name
        view._param, view._has_param = recipe.param, recipe.has_param
        return view

    def _whose(self) -> str:
        return "a test function" if self.fixturename is None else f"fixture {self.fixturename!r}"


# The fixtures RankFixtures.make makes (the rank fills `rank` and `device` in as plain values).
MADE_HERE = frozenset(RANK_SIDE_FIXTURES) - {"rank", "device"}


class RankFixtures:
    """Makes the fixtures a test asked for in this rank, and undoes them after the body, the
    latest first, as pytest does."""

    def __init__(self, rank: int, info: RequestInfo | None) -> None:
        self._rank = rank
        self._stack = contextlib.ExitStack()
        self._request = RankRequest(info, self._stack.callback) if info is not None else None
        self._caplogs: list[tuple[Any, dict[str, Any]]] = []  # (handler, records by phase)

    def bind(self, test: Callable[..., Any]) -> None:
        """The test function the fixtures are made for: its request names it."""
        if self._request is not None:
            self._request.bind(test)

    def make(self, sent: dict[str, Any]) -> dict[str, Any]:
        """Values for the rank-side fixtures among `sent` (the pytest side's values)."""
        if sent.keys().isdisjoint(MADE_HERE):
            return {}  # most tests: no makers to build
        makers: dict[str, Callable[[Any], Any]] = {
            "monkeypatch": lambda _: self._stack.enter_context(pytest.MonkeyPatch.context()),
            "capsys": lambda _: self._capture("SysCapture"),
            "capsysbinary": lambda _: self._capture("SysCaptureBinary"),
            "capfd": lambda _: self._capture("FDCapture"),
            "capfdbinary": lambda _: self._capture("FDCaptureBinary"),
            "caplog": self._caplog,
            "recwarn": lambda _: self._stack.enter_context(pytest.WarningsRecorder(_ispytest=True)),
            "request": lambda _: self._request,
            "tmp_path": self._tmp_path,
            "tmpdir": lambda base: _legacy_path(self._tmp_path(base)),
        }
        return {name: make(sent[name]) for name, make in makers.items() if name in sent}

    def make_fixtures(
        self, plan: FixturePlan, made: dict[str, Any], holder: object, load: LoadModule
    ) -> None:
        """Call the fixtures of `plan` in order, each with values from `made` (the test's
        arguments and the plan's values, rank-side ones made), adding each to `made`.
        `holder` is the test's class instance, for fixtures defined in its class; `load`
        loads a module from its file (the worker's, as it loads test modules)."""
        for recipe in plan.recipes:
            kwargs = {
                param: self._request.for_fixture(recipe)
                if param == "request" and self._request is not None
                else made[key]
                for param, key in recipe.args
            }
            function = _fixture_function(recipe, holder, load)
            made[recipe.key] = self._call(recipe, function, kwargs)

    def _call(self, recipe: FixtureRecipe, function: Callable[..., Any], kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
            pytest.fail(f"fixture {recipe.name!r} is async: pytest runs no async fixture", False)
        if not inspect.isgeneratorfunction(function):
            return function(**kwargs)
        generator = function(**kwargs)
        try:
            value = next(generator)
        except StopIteration:
            raise ValueError(f"fixture {recipe.name!r} did not yield a value") from None
        self._stack.callback(_finish, recipe.name, generator)
        return value

    def enter_phase(self, when: str) -> None:
        """The test moves on to phase `when` ("call", "teardown"): as in pytest, caplog's
        records are that phase's from now on, and get_records keeps the earlier ones."""
        for handler, records in self._caplogs:
            handler.reset()
            records[when] = handler.records

    def close(self) -> None:
        """Undo everything made and run the finalizers, the latest first."""
        self.enter_phase("teardown")
        self._stack.close()

    def _capture(self, kind: str) -> Any:
        request: Any = self._request  # kept, not read: disabled() is the rank's own
        fixture = _RankCapture(pytest_internals.capture_class(kind), request, _ispytest=True)
        fixture._start()
        self._stack.callback(fixture.close)
        return fixture

    def _caplog(self, level: int | None) -> Any:
        """pytest's caplog for this rank, capturing from `level` (the session's log_level)."""
        pytest_logging = pytest_internals.logging_plugin()
        handler = pytest_logging.LogCaptureHandler()
        holder = _StashHolder()
        holder.stash[pytest_logging.caplog_handler_key] = handler
        records = {"setup": handler.records}  # made while the test's fixtures are set up
        holder.stash[pytest_logging.caplog_records_key] = records
        self._caplogs.append((handler, records))
        self._stack.enter_context(pytest_logging.catching_logs(handler, level=level))
        fixture = pytest_logging.LogCaptureFixture(holder, _ispytest=True)
        self._stack.callback(fixture._finalize)
        return fixture

    def _tmp_path(self, base: Any) -> Path:
        """The pytest side's tmp_path for the test, and below it one directory per rank."""
        path = Path(str(base)) / f"rank{self._rank}"
        path.mkdir(parents=True, exist_ok=True)
        return path


class _RankCapture(pytest.CaptureFixture):  # type: ignore[type-arg]
    """pytest's capsys/capfd in a rank, where there is no capture manager to step around."""

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Output goes to the rank's own streams: the report's rank sections, live with -s."""
        self._suspend()
        try:
            yield
        finally:
            self._resume()


class _StashHolder:
    """Just enough of a node for pytest's LogCaptureFixture: a stash."""

    def __init__(self) -> None:
        self.stash = pytest.Stash()


def _finish(name: str, generator: Any) -> None:
    """A yield fixture's teardown: the rest of its function, which must not yield again."""
    try:
        next(generator)
    except StopIteration:
        return
    pytest.fail(f"fixture {name!r} has more than one 'yield'", pytrace=False)


def _fixture_function(
    recipe: FixtureRecipe, holder: object, load: LoadModule
) -> Callable[..., Any]:
    """The function of a fixture the rank makes, found by name; bound to the test's class
    instance when the fixture is a method of its class (a new instance for another class)."""
    found: Any = _fixture_module(recipe, load)
    parts = recipe.qualname.split(".")
    for part in parts[:-1]:
        found = getattr(found, part)
    function: Callable[..., Any] = _unwrapped(getattr(found, parts[-1]))
    if isinstance(found, type):
        instance = holder if isinstance(holder, found) else found()
        return functools.partial(function, instance)
    return function


def _fixture_module(recipe: FixtureRecipe, load: LoadModule) -> types.ModuleType:
    """The module the fixture's function lives in: by name, unless that name holds another
    file (two conftest.py outside packages are both "conftest"), then that file's own,
    loaded by `load` under a name of its own."""
    module = importlib.import_module(recipe.module)
    here = getattr(module, "__file__", None)
    if recipe.file is None or (here is not None and _same_path(here, recipe.file)):
        return module
    return load(f"_harness_fixtures_{zlib.crc32(recipe.file.encode()):08x}", recipe.file)


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _unwrapped(obj: Any) -> Any:
    """The plain function under pytest's fixture decoration (pytest 8.4+, and before)."""
    get = getattr(obj, "_get_wrapped_function", None)
    if get is not None:
        return get()
    wrapped = getattr(obj, "__pytest_wrapped__", None)
    return wrapped.obj if wrapped is not None else obj


def _legacy_path(path: Path) -> Any:
    return pytest_internals.legacy_path(path)
