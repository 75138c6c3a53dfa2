"""Running one test, or one run_on_ranks call, on its ranks and judging how every rank ended.

Loaded with the plugin but imports no torch: ``harness.pool`` is imported when a test first
needs ranks.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pytest
from _pytest.outcomes import Failed

from harness import expect as expectations
from harness import faults as fault_specs
from harness import made_in_ranks, rank_warnings
from harness.errors import SpecError
from harness.faults import Fault
from harness.hygiene import CHECKS
from harness.outcome import (
    Ending,
    RankOutcome,
    failure_text,
    ranks_phrase,
    root_cause,
    set_up_failure_text,
)
from harness.protocol import (
    RANK_SIDE_FIXTURES,
    FixturePlan,
    FixtureRecipe,
    RankSpec,
    RequestInfo,
    Target,
    encode_args,
)
from harness.settings import settings_of, spec_for_call

if TYPE_CHECKING:
    from harness.pool import LiveStreams, Pools

_pools_key = pytest.StashKey["Pools"]()
_leftovers_key = pytest.StashKey[str]()
# Set when a rank's fault never fired: the test is written wrong, which no xfail expects.
_no_xfail_key = pytest.StashKey[bool]()
FAULT_NOT_REACHED = "harness.faults.FaultNotReached"


class RankLeftovers(Exception):
    """A rank test left a process group, threads or environment changes behind."""


class RanksReplacedWarning(pytest.PytestWarning):
    """A rank test left daemon threads running, so its ranks were replaced before the next
    test (a start of new ranks); ``@pytest.mark.allow_leftovers("threads")`` keeps them."""


class HarnessError(Failed):  # pytest.fail's exception: reported with its message alone
    """The harness itself could not run the test: reported as an error, not a failure."""


# ---- a ranks-marked test ------------------------------------------------------------------


def run_marked_test(item: pytest.Function, spec: RankSpec) -> None:
    """Run `item`'s body on every rank of `spec` and pass, skip or fail it by their endings."""
    spec = with_fixture_faults(item, spec)
    outcomes = run(item.config, spec, test_target(item), sendable_funcargs(item))
    stop_if_a_rank_did(outcomes)
    rank_warnings.reemit(outcomes)
    _warn_of_returned_values(item, outcomes)
    _warn_of_replaced_ranks(item, outcomes)
    record_leftovers(item, outcomes)
    attach_output(item, outcomes)
    judge(item, spec, outcomes)


def stop_if_a_rank_did(outcomes: list[RankOutcome]) -> None:
    """pytest.exit() or KeyboardInterrupt in a rank stops the session, as in a plain test."""
    for o in outcomes:
        if o.ending is not Ending.RAISED:
            continue
        if o.exc_type == "_pytest.outcomes.Exit":
            code = o.exit_code if o.exit_code is not None else pytest.ExitCode.INTERRUPTED
            pytest.exit(f"[rank {o.rank}] {o.message}", returncode=code)
        if o.exc_type == "builtins.KeyboardInterrupt":
            raise KeyboardInterrupt(f"in rank {o.rank}")


def _warn_of_returned_values(item: pytest.Function, outcomes: list[RankOutcome]) -> None:
    """pytest's warning for a test function that returns a value, from its ranks."""
    returned = [o for o in outcomes if o.ending is Ending.RETURNED and o.value_repr]
    if returned:
        ranks = ranks_phrase([o.rank for o in returned])
        warnings.warn(
            pytest.PytestReturnNotNoneWarning(
                f"test functions should return None, but {item.nodeid} returned "
                f"{returned[0].value_repr} on {ranks}; use assert (or run_on_ranks to get "
                f"values back)"
            ),
            stacklevel=1,
        )


def _warn_of_replaced_ranks(item: pytest.Function, outcomes: list[RankOutcome]) -> None:
    """Say why ranks were replaced after a passing test: each replacement costs a start."""
    why = [f"rank {o.rank} {o.replace_after}" for o in outcomes if o.replace_after]
    if why:
        warnings.warn(
            RanksReplacedWarning(
                f"{item.nodeid}: {'; '.join(why)} (a thread that would act in a later test; "
                f"one a library keeps for the process: @pytest.mark.allow_leftovers('threads') "
                f"keeps the ranks)"
            ),
            stacklevel=1,
        )


def with_fixture_faults(item: pytest.Function, spec: RankSpec) -> RankSpec:
    extra = _fixture_faults(item)
    if not extra:
        return spec
    origin = f"the rank_faults fixture of {item.nodeid}"
    try:
        more = tuple(fault_specs.validate(f, spec.world_size, origin) for f in extra)
    except fault_specs.FaultError as exc:
        pytest.fail(str(exc), pytrace=False)
    return replace(spec, faults=spec.faults + more)


def _fixture_faults(item: pytest.Function) -> Any:
    """The rank_faults fixture's value for `item`, without pytest's fixture machinery (~0.1 ms a
    test) where only the plugin's own definition, which returns none, is visible to it."""
    if "rank_faults" in item.funcargs:  # the test asked for it: pytest has it already
        return item.funcargs["rank_faults"]
    try:
        defs = item.session._fixturemanager.getfixturedefs("rank_faults", item) or ()
        only_ours = len(defs) == 1 and defs[0].func.__module__ == "harness.plugin"
    except Exception:  # another pytest's internals: ask pytest
        only_ours = False
    return [] if only_ours else item._request.getfixturevalue("rank_faults")


def test_target(item: pytest.Function) -> Target:
    """Where a rank finds the test function: its module, its file, its qualified name."""
    module = item.module
    assert module is not None
    qualname = item.originalname
    if item.cls is not None:
        qualname = f"{item.cls.__qualname__}.{item.originalname}"
    modules, packages = test_modules(module)
    return Target(module.__name__, getattr(module, "__file__", None), qualname, modules, packages)


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


def sendable_funcargs(item: pytest.Function) -> bytes:
    """The test's arguments resolved here, encoded for the trip to the ranks.

    Fixtures the ranks make for themselves travel as what they are built from. A value that
    cannot travel fails the test naming its fixture; each value is pickled on its own only
    then, to find it. A test class instance's attributes (set by setup_method) travel too.
    """
    kwargs = {name: _sent_value(item, name) for name in item._fixtureinfo.argnames}
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
    return {k: v for k, v in changed.items() if _pickles(v)} or None


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
        from _pytest.logging import get_log_level_for_setting

        return get_log_level_for_setting(item.config, "log_level")
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
        flags=_picklable_once(config, "flags", dict(getattr(config._parser, "_opt2dest", {}))),
        path=str(item.path),
    )


def _ini(config: pytest.Config, name: str) -> Any:
    try:
        return config.getini(name)
    except Exception:
        return None


def _mark_that_travels(mark: pytest.Mark) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    args = tuple(a if _pickles(a) else repr(a) for a in mark.args)
    kwargs = {k: v if _pickles(v) else repr(v) for k, v in mark.kwargs.items()}
    return mark.name, args, kwargs


def _picklable(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items() if _pickles(value)}


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


def _pickles(value: Any) -> bool:
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


def attach_output(item: pytest.Item, outcomes: list[RankOutcome]) -> None:
    """Every rank's output and log on the report, one section per rank and stream, as pytest
    keeps a plain test's (-rP, -rA, junit xml), passing or not."""
    for o in outcomes:
        for stream, text in (("stdout", o.stdout), ("stderr", o.stderr), ("log", o.log)):
            if text:
                item.add_report_section("call", f"{stream} [rank {o.rank}]", text)


def record_leftovers(item: pytest.Item, outcomes: list[RankOutcome]) -> None:
    """What the ranks left behind, for raise_leftovers to raise at teardown."""
    text = leftovers_text(outcomes, allow_hint=True)
    if text is not None:
        item.stash[_leftovers_key] = text


def leftovers_text(outcomes: list[RankOutcome], allow_hint: bool = False) -> str | None:
    """'hygiene: rank 1 left ...', a line per finding; None when the ranks left nothing."""
    lines = [f"rank {o.rank} {finding}" for o in outcomes for finding in o.leftovers.values()]
    if not lines:
        return None
    kinds = sorted({k for o in outcomes for k in o.leftovers if k in CHECKS})
    listed = ", ".join(f"'{kind}'" for kind in kinds)
    hint = allow_hint and kinds
    hints = [f"(a test that means it: @pytest.mark.allow_leftovers({listed}))"] if hint else []
    return "\n".join(["hygiene: " + lines[0], *lines[1:], *hints])


def raise_leftovers(item: pytest.Item) -> None:
    """At teardown: a test that left things behind in a rank errors, naming the rank."""
    text = item.stash.get(_leftovers_key, None)
    if text is not None:
        raise RankLeftovers(text)


def judge(item: pytest.Item, spec: RankSpec, outcomes: list[RankOutcome]) -> None:
    """Pass only if every rank ended as expected; otherwise fail with the root cause first.

    pytest's own outcomes raised in ranks count as in a plain test: a skip or an xfail on
    every rank (the others returning, for an xfail) skips or xfails the test.
    """
    if all(o.setup_failed for o in outcomes):
        raise HarnessError(set_up_failure_text(outcomes), pytrace=False)
    if all(o.ending is Ending.SKIPPED for o in outcomes):  # reported where rank 0 skipped
        if outcomes[0].skipped_at is not None:
            item.stash[_skipped_at_key] = outcomes[0].skipped_at
        raise pytest.skip.Exception(outcomes[0].message, _use_item_location=True)
    note_missed_faults(item, outcomes)
    _xfail_if_ranks_did(outcomes)
    _fail_a_partial_skip(outcomes)
    text = failure_text(outcomes, spec.expected)
    if text is not None:
        first, _, rest = text.partition("\n")
        ranks = f"{spec.world_size} rank{'s' if spec.world_size != 1 else ''}"
        message = f"{first}  [{ranks}, {item.nodeid}]\n{rest}"
        raise _as_the_xfail_marker_expects(item, root_cause(outcomes, spec.expected), message)


_skipped_at_key = pytest.StashKey[tuple[str, int]]()


def place_skip(item: pytest.Item, report: pytest.TestReport) -> None:
    """A skip on every rank is reported where the ranks skipped (file and line), as pytest
    reports a plain test's, not at the test's own line."""
    at = item.stash.get(_skipped_at_key, None)
    if at is not None and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (at[0], at[1], report.longrepr[2])


def note_missed_faults(item: pytest.Item | None, outcomes: list[RankOutcome]) -> None:
    """Remember, for refuse_xfail, that a rank's fault never fired in `item`."""
    if item is not None and any(o.exc_type == FAULT_NOT_REACHED for o in outcomes):
        item.stash[_no_xfail_key] = True


def refuse_xfail(item: pytest.Item, report: pytest.TestReport) -> None:
    """Fail a test an xfail marker would have xfailed, where a rank's fault never fired."""
    if item.stash.get(_no_xfail_key, False) and hasattr(report, "wasxfail"):
        report.outcome = "failed"
        del report.wasxfail


def _xfail_if_ranks_did(outcomes: list[RankOutcome]) -> None:
    """Xfail when ranks xfailed and every other rank returned, or failed only for it (a peer
    waiting on an xfailed rank in a collective)."""
    xfailed = [o for o in outcomes if o.ending is Ending.XFAILED]
    others = [o for o in outcomes if o.ending not in (Ending.XFAILED, Ending.RETURNED)]
    if xfailed and all(o.looks_collateral for o in others):
        pytest.xfail(xfailed[0].message)


def _fail_a_partial_skip(outcomes: list[RankOutcome]) -> None:
    skipped = [o.rank for o in outcomes if o.ending is Ending.SKIPPED]
    ran = [o.rank for o in outcomes if o.ending is Ending.RETURNED]
    if skipped and len(skipped) + len(ran) == len(outcomes):
        reason = next(o.message for o in outcomes if o.ending is Ending.SKIPPED)
        pytest.fail(
            f"{ranks_phrase(skipped)} skipped ({reason}) while {ranks_phrase(ran)} ran: skip on "
            f"every rank or on none (decide from something every rank sees alike)",
            pytrace=False,
        )


def _as_the_xfail_marker_expects(
    item: pytest.Item, root: RankOutcome | None, message: str
) -> BaseException:
    """The failure to raise: pytest.fail's, or for xfail(raises=E) with E (or a subclass)
    raised on the root cause's rank, an E, which is what pytest's xfail checks."""
    mark = item.get_closest_marker("xfail")
    raises = mark.kwargs.get("raises") if mark is not None else None
    failure = Failed(message, pytrace=False)
    if raises is None or root is None or root.ending is not Ending.RAISED:
        return failure
    wanted = raises if isinstance(raises, tuple) else (raises,)
    for cls in wanted:
        if isinstance(cls, type) and issubclass(cls, BaseException) and _named(cls, root):
            with contextlib.suppress(Exception):
                error: BaseException = cls.__new__(cls)
                error.args = (message,)
                return error
    return failure


def _named(cls: type, root: RankOutcome) -> bool:
    return expectations.class_name(cls) in root.exc_classes


@contextlib.contextmanager
def pytest_timeout_paused(item: pytest.Item) -> Iterator[None]:
    """pytest-timeout's timer off while the harness runs the body under its own bound, and
    set afresh for the teardown after it (pytest-timeout times the whole protocol)."""
    hooks = item.config.pluginmanager.hook
    timing = item.config.pluginmanager.get_plugin("timeout")
    settings_of_item = getattr(timing, "_get_item_settings", None)
    if settings_of_item is None:  # pytest-timeout not loaded (or another version of it)
        yield
        return
    settings = settings_of_item(item)
    if not settings.timeout:
        yield
        return
    hooks.pytest_timeout_cancel_timer(item=item)
    try:
        yield
    finally:
        if not settings.func_only:
            hooks.pytest_timeout_set_timer(item=item, settings=settings)


def skip_without_gpus(needed: int) -> None:
    """Skip the current test, at its own location, when fewer than `needed` GPUs are here."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        raise pytest.skip.Exception(
            f"needs {needed} CUDA GPU(s), this machine has {have}", _use_item_location=True
        )


# ---- the pools ----------------------------------------------------------------------------


def run(
    config: pytest.Config, spec: RankSpec, target: Target, args_blob: bytes
) -> list[RankOutcome]:
    """Run `target` with the encoded (args, kwargs) on every rank of a warm pool for `spec`."""
    from harness.pool import RunRequest

    return pools_of(config).run(RunRequest(spec, target, args_blob, _live_streams(config)))


def _live_streams(config: pytest.Config) -> LiveStreams | None:
    """-s, -p no:capture and --capture=tee-sys: where rank output goes as it comes (None:
    kept only for the report). Under tee-sys, the streams its capture tees to: written to
    the capture itself, rank output would be shown again as the test's own (tee-sys keeps
    it in the ranks' report sections already)."""
    from harness.pool import LiveStreams

    method = config.getoption("capture", None)
    if method in ("no", None):  # -s, or -p no:capture (no capture plugin, no option)
        return LiveStreams()
    if method != "tee-sys":
        return None
    capman = config.pluginmanager.getplugin("capturemanager")
    capturing = getattr(capman, "_global_capturing", None)  # pytest's own: None if it changes
    return LiveStreams(
        getattr(getattr(capturing, "out", None), "_old", None),
        getattr(getattr(capturing, "err", None), "_old", None),
    )


def pools_of(config: pytest.Config) -> Pools:
    if _pools_key not in config.stash:
        from harness.pool import Pools

        config.stash[_pools_key] = Pools()
    return config.stash[_pools_key]


def close_pools(config: pytest.Config) -> list[int]:
    """Kill every rank of the session; the pids still alive after that (there should be none)."""
    pools = config.stash.get(_pools_key, None)
    return [] if pools is None else pools.close()


def stop_forkserver() -> None:
    """End the fork server ranks came from, if this process started ranks (pool's)."""
    pool = sys.modules.get("harness.pool")
    if pool is not None:
        pool.stop_forkserver()


# ---- any function on ranks, from the pytest process --------------------------------------


@dataclass
class WorldOutcome:
    """Every rank's outcome of one `run_on_ranks` call, in rank order."""

    ranks: list[RankOutcome]

    def __getitem__(self, rank: int) -> RankOutcome:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[RankOutcome]:
        return iter(self.ranks)

    @property
    def values(self) -> list[Any]:
        """Each rank's return value; raises if any rank did not return."""
        bad = [o for o in self.ranks if not o.ok]
        if bad:
            raise AssertionError(self.report())
        return [o.value for o in self.ranks]

    @property
    def endings(self) -> list[Ending]:
        """How each rank ended, in rank order."""
        return [o.ending for o in self.ranks]

    def report(self) -> str:
        """The failure report, root cause first, or 'every rank returned'."""
        return failure_text(self.ranks) or "every rank returned"

    def expect(self, *args: Any, **kwargs: Any) -> None:
        """Assert how each rank ended, in the expect marker's forms; the table on a mismatch."""
        wanted = expectations.from_marker(args, kwargs, len(self.ranks), "WorldOutcome.expect")
        text = failure_text(self.ranks, wanted)
        if text is not None:
            raise AssertionError(text)


class RankRunner:
    """Runs a module-level function on every rank of a world and returns every outcome."""

    def __init__(self, config: pytest.Config, node: pytest.Item | None = None) -> None:
        self._config = config
        self._node = node

    def __call__(
        self,
        fn: Callable[..., Any],
        *args: Any,
        world_size: int | None = None,
        timeout: float | None = None,
        launch: bool = False,
        backend: str | None = None,
        faults: list[Fault] | tuple[Fault, ...] = (),
        **kwargs: Any,
    ) -> WorldOutcome:
        target = function_target(fn)
        settings = settings_of(self._config)
        spec = spec_for_call(
            self._config, settings, self._node, world_size, timeout, launch, backend, faults
        )
        if settings.launched is not None and self._node is not None:
            from harness.launched import hooks as launched_hooks

            outcomes = launched_hooks.run_call(self._config, self._node, spec, fn, args, kwargs)
            rank_warnings.reemit(outcomes)
            note_missed_faults(self._node, outcomes)
            return WorldOutcome(outcomes)
        if spec.backend == "nccl":
            skip_without_gpus(spec.world_size)
        outcomes = run(self._config, spec, target, encode_args(args, kwargs))
        rank_warnings.reemit(outcomes)
        note_missed_faults(self._node, outcomes)
        return WorldOutcome(outcomes)


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
