"""Existing suites on warm ranks: ``--rank-adopt torch,deepspeed`` (ini ``rank_adopt``), or a
project's own base. The seam: an Adopter is one multi-rank test base; torch's
``MultiProcessTestCase`` family (torch/adopter.py) and DeepSpeed's ``DistributedTest``
(deepspeed/adopter.py) are two instances, and a project adds its own from the
``pytest_harness_adopters`` hook (docs/existing-suites.md, "Adopt your project's base").
Here: the Adopter base, the registry (``--rank-adopt``'s values come from it), the hooks that
hand each test to the adopters the session asked for, and the steps they share.

An adopter replaces only how its base starts and joins processes; the rest is written once
here: the run's spec (no group set up: the class sets its own; the harness's bound, hygiene
and seed), the ranks' import of the class's module under its own bound, the run on warm
ranks, the one sequence after a body (runner.after_body) with the adopter's verdict, and
one line in the summary for each class that runs as before, saying why. Imports no torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from harness import seam
from harness.adopt import ranks
from harness.common import rank_warnings
from harness.common.errors import invalid
from harness.common.outcome import RankOutcome
from harness.common.protocol import RankSpec, Target, encode_args
from harness.plan import adopter_needs, packing, seeds, timeout_interop
from harness.plan.settings import session_timeout, settings_of
from harness.pytest_side import runner

# What an adopted rank is checked for after the test: the base ends its processes, so a group
# or environment left behind is normal (the worker resets both), but a thread or process that
# keeps running would meet the next test.
ADOPTED_HYGIENE = frozenset({"threads", "processes"})
_T = TypeVar("_T")
# An adopter's own verdict from every rank's outcome (the harness's by default).
Judge = Callable[[pytest.Item, RankSpec, list[RankOutcome]], None]


class Adopter:
    """One multi-rank test base, adopted when ``--rank-adopt`` names it (`name`).

    Override what the base needs; every method has a harmless default. The base's tests keep
    their source: an adopter replaces only how the base starts and joins its processes, and
    hands each test's ranks to the harness (`run`).
    """

    name = ""  # the --rank-adopt value
    # Top-level packages the base's suites test from a source checkout: the fork server
    # imports them early, wherever they come from (a new rank costs a fork, not their import).
    libraries: tuple[str, ...] = ()

    def claims(self, cls: type) -> bool:
        """Whether `cls` is a test class on this base (asked of every registered adopter,
        asked for or not: another adopter leaves such a class alone, saying which to ask)."""
        return False

    def collected(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Once the tests are collected: replace the base's launch, note each test's bound."""

    def setting_up(self, item: pytest.Item) -> None:
        """Before `item`'s set-up (its class's set-up included)."""

    def calling(self, item: pytest.Item) -> None:
        """Before `item`'s call: point the test instance's spawning at the harness."""

    def ended(self, config: pytest.Config) -> None:
        """At the session's end: put back what the adopter replaced."""

    def endings(self, config: pytest.Config) -> list[Callable[[], None]]:
        """Cleanups for the warm ranks' end when a signal ends the session (what the base's
        runs leave outside their processes)."""
        return []

    def not_asked(self) -> str:
        """Why a class on this base runs as it is when the session did not ask for it."""
        return (
            f"{self.name}'s test base starts processes of its own; add {self.name} to "
            f"--rank-adopt to run it on warm ranks"
        )

    def run(
        self,
        item: pytest.Item,
        world_size: int,
        entry: Callable[..., Any],
        cls: type,
        *args: Any,
        timeout: float | None = None,
        judged_by: Judge | None = None,
    ) -> None:
        """Run `item` on `world_size` warm ranks: `entry(cls, *args, rank=r)` on each, then
        judged as a ranks test is (every rank's end counts, the root cause first), or by
        `judged_by` where the base gives some ends a meaning of its own (torch's skip
        statuses). `entry` is a module-level function (the base's per-rank entry point);
        `cls`, the test class, reaches each rank from its module as pytest imported it;
        `args` travel pickled. The ranks' run goes through `attempts`."""
        _running(self, item)
        spec = adopted_spec(item, world_size, timeout)
        targets = (packing.function_target(cls), packing.function_target(entry))

        def run_once(given: tuple[Any, ...]) -> list[RankOutcome]:
            return run_adopted(item, spec, ranks.run_with_class, (*targets, *given))

        _judged_attempts(self, item, spec, run_once, args, judged_by)

    def attempts(
        self,
        item: pytest.Item,
        run_once: Callable[[tuple[Any, ...]], list[RankOutcome]],
        args: tuple[Any, ...],
    ) -> list[RankOutcome]:
        """The ranks' run of `item` (`run_once(args)` runs `entry(cls, *args)` on every rank
        and gives each rank's outcome): once, by default. A base whose run can be set right
        and tried again overrides this (DeepSpeed's builds an op the ranks lacked and runs
        again, each run on a store of its own): the last outcomes are the test's."""
        return run_once(args)

    def run_function(
        self,
        item: pytest.Item,
        world_size: int,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
    ) -> None:
        """Run `item` on `world_size` warm ranks as a base that is a function starts its
        processes (``spawn(fn, nprocs)``, ``torch.multiprocessing.spawn(fn, args)``):
        `fn(rank, *args)` on each, judged as `run` judges. `fn` is module-level (each rank
        imports its module, as pytest imported it); `args` travel pickled."""
        _running(self, item)
        spec = adopted_spec(item, world_size, timeout)
        target = packing.function_target(fn)

        def run_once(given: tuple[Any, ...]) -> list[RankOutcome]:
            return run_adopted(item, spec, ranks.run_spawned, (target, given))

        _judged_attempts(self, item, spec, run_once, args, None)

    def note(self, item: pytest.Item, why: str) -> None:
        """`item`'s class runs as it is, and the session's summary says why, once."""
        cls = getattr(item, "cls", None)
        where = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else item.nodeid
        note_not_adopted(item.config, where, why)


class AdopterError(Exception):
    """A project's adopter that cannot be registered: says which and why."""


_registry_key = pytest.StashKey[dict[str, Adopter]]()
_asked_key = pytest.StashKey[frozenset[str]]()
_project_key = pytest.StashKey[set[str]]()  # the adopters a project registered (the hook)


def register_adopters(config: pytest.Config, built_in: list[Adopter]) -> None:
    """The session's adopters as pytest configures: the harness's own (`built_in`), then
    the projects' from plugins and initial conftests (the ``pytest_harness_adopters``
    hook). What the asked ones give the warm layer is handed over (adopter_needs.py). A bad one:
    a usage error. ``--rank-adopt``'s names are checked once the tests are collected: a
    conftest below the rootdir registers its adopter as pytest collects its directory."""
    config.stash[_registry_key] = {a.name: a for a in built_in}
    config.stash[_project_key] = set()
    _register_projects(config)
    config.stash[_asked_key] = settings_of(config).adopt
    chosen = asked(config)
    libraries = frozenset(name for a in chosen for name in a.libraries)
    adopter_needs.give(config, libraries, [fn for a in chosen for fn in a.endings(config)])


def _register_projects(config: pytest.Config) -> None:
    """The projects' adopters the hook gives now (each name once: a conftest's hook asked
    again gives a new instance of the same class, which changes nothing)."""
    found = config.stash[_registry_key]
    for given in config.hook.pytest_harness_adopters(config=config):
        for adopter in given or ():
            known = found.get(getattr(adopter, "name", None))  # type: ignore[arg-type]
            if known is not None and type(known) is type(adopter):
                continue
            why = _why_refused(adopter, found)
            if why is not None:
                raise pytest.UsageError(f"harness: {why}")
            found[adopter.name] = adopter
            config.stash[_project_key].add(adopter.name)


def _check_asked(config: pytest.Config) -> None:
    """Every name --rank-adopt gives is a registered adopter's, now that every conftest of
    the session has registered its own."""
    found = registered(config)
    unknown = sorted(config.stash.get(_asked_key, frozenset()) - set(found))
    if unknown:
        given = config.getoption("rank_adopt", None)
        origin = "--rank-adopt" if given is not None else "ini option 'rank_adopt'"
        fix = (
            f"use {', '.join(found)} (a project registers its own base's adopter with the "
            f"pytest_harness_adopters hook, in a conftest or plugin)"
        )
        raise pytest.UsageError(f"harness: {invalid('rank_adopt', ','.join(unknown), origin, fix)}")


def _why_refused(adopter: Any, found: dict[str, Adopter]) -> str | None:
    if not isinstance(adopter, Adopter):
        return (
            f"pytest_harness_adopters returned {adopter!r}: return instances of a subclass "
            f"of harness.Adopter"
        )
    if not adopter.name or "," in adopter.name or adopter.name in found:
        return (
            f"{type(adopter).__qualname__}: its name {adopter.name!r} must be new, non-empty "
            f"and without commas (taken: {', '.join(found)})"
        )
    return None


def registered(config: pytest.Config) -> dict[str, Adopter]:
    """Every adopter of the session, by name."""
    return config.stash.get(_registry_key, {})


def asked(config: pytest.Config) -> list[Adopter]:
    """The adopters the session asked for (``--rank-adopt``), in the order registered."""
    names = config.stash.get(_asked_key, frozenset())
    return [a for name, a in registered(config).items() if name in names]


@dataclass
class _Summary:
    not_adopted: dict[str, str] = field(default_factory=dict)  # where -> why, of what ran


_summary_key = pytest.StashKey[_Summary]()
_timeout_key = pytest.StashKey[float]()  # an adopted test's bound for its ranks, read at collection


def _summary(config: pytest.Config) -> _Summary:
    return session_state(config, _summary_key, _Summary)


def session_state(config: pytest.Config, key: pytest.StashKey[_T], make: Callable[[], _T]) -> _T:
    """What an adopter keeps for the session under `key` in the config's stash (made on first
    use, gone with the session)."""
    if key not in config.stash:
        config.stash[key] = make()
    return config.stash[key]


# ---- hooks: each handed to the adopters asked for -------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _registry_key in config.stash:
        _register_projects(config)  # the conftests pytest found as it collected
        _check_asked(config)
    for adopter in asked(config):
        adopter.collected(config, items)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    for adopter in asked(item.config):
        adopter.setting_up(item)
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    claimed = _claimed_by_a_project(item)
    item.config.stash[_calling_key] = (item, set())
    for adopter in asked(item.config):
        adopter.calling(item)
    try:
        result = yield
    finally:
        _, ran = item.config.stash[_calling_key]
        del item.config.stash[_calling_key]
    if claimed is not None and claimed.name not in ran:
        raise AdopterError(
            f"harness: adopter {claimed.name!r} ({type(claimed).__qualname__}) claims "
            f"{item.nodeid} but did not run it on ranks: its calling() must point the base's "
            f"spawn at self.run(item, ...) (or self.run_function) for this item, or its "
            f"claims() leave the class alone"
        )
    return result


# The test being called, and the adopters that ran it on ranks.
_calling_key = pytest.StashKey[tuple[pytest.Item, set[str]]]()


def _claimed_by_a_project(item: pytest.Item) -> Adopter | None:
    """The project's adopter (one the session asked for) that claims `item`'s class."""
    cls = getattr(item, "cls", None)
    projects = item.config.stash.get(_project_key, set())
    if not isinstance(cls, type):
        return None
    return next((a for a in asked(item.config) if a.name in projects and a.claims(cls)), None)


def _running(adopter: Adopter, item: pytest.Item) -> None:
    """`adopter` runs `item` on ranks: the test being called, or an error naming it."""
    calling = item.config.stash.get(_calling_key, None)
    if calling is not None and calling[0] is not item:
        raise AdopterError(
            f"harness: adopter {adopter.name!r} ({type(adopter).__qualname__}) ran "
            f"{item.nodeid} while {calling[0].nodeid} was being called: pass run() the item "
            f"given to calling() for this test (an item kept from an earlier test labels "
            f"the report with the wrong test)"
        )
    if calling is not None:
        calling[1].add(adopter.name)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    by_reason: dict[str, list[str]] = {}
    for where, why in _summary(config).not_adopted.items():
        by_reason.setdefault(why, []).append(where)
    for why, places in by_reason.items():  # once per reason: a suite has hundreds of classes
        where = places[0] if len(places) == 1 else _some(places)
        terminalreporter.write_line(f"harness: not adopted, runs as before: {where}: {why}")


def _some(places: list[str], shown: int = 3) -> str:
    more = f", and {len(places) - shown} more" if len(places) > shown else ""
    return f"{len(places)} classes ({', '.join(places[:shown])}{more})"


def pytest_unconfigure(config: pytest.Config) -> None:
    for adopter in asked(config):
        adopter.ended(config)


# ---- what every adopter shares --------------------------------------------------------------


def claimed_elsewhere(config: pytest.Config, cls: type, mine: str) -> str | None:
    """Why `cls` is not `mine`'s to adopt, if another registered adopter claims it: None
    where none does, or where that one is asked for too (it takes the class)."""
    names = config.stash.get(_asked_key, frozenset())
    for adopter in registered(config).values():
        if adopter.name == mine or not adopter.claims(cls):
            continue
        return None if adopter.name in names else adopter.not_asked()
    return None


def base_named(cls: type, name: str, parts: tuple[str, ...]) -> type | None:
    """The class among `cls`'s bases (itself included) called `name` that has `parts`."""
    for owner in cls.__mro__:
        if owner.__name__ == name and all(callable(getattr(owner, p, None)) for p in parts):
            return owner
    return None


def parameters_of(fn: Any) -> list[str]:
    """`fn`'s parameter names, without cls or self ([] when it has no signature)."""
    try:
        return [p for p in inspect.signature(fn).parameters if p not in ("cls", "self")]
    except (TypeError, ValueError):
        return []


def set_timeout(item: pytest.Item, seconds: float) -> None:
    """`item`'s bound for its ranks, as its adopter reads it at collection (adopted_spec)."""
    item.stash[_timeout_key] = seconds


def adopted_spec(item: pytest.Item, world_size: int, timeout: float | None = None) -> RankSpec:
    """A run with no group set up (the class sets its own) under the harness's bound (or
    `timeout`, the adopter's own choice of it)."""
    if world_size < 1:
        pytest.skip(
            f"world_size is {world_size}: no rank to run the test on (torch spawns no process "
            f"and passes the test without running it)"
        )
    settings = settings_of(item.config)
    return RankSpec(
        world_size=world_size,
        timeout_s=timeout or item.stash.get(_timeout_key, None) or session_timeout(settings, item),
        backend=settings.backend,
        start_method=settings.start_method,
        bare=True,
        hygiene=ADOPTED_HYGIENE,
        warning_filters=rank_warnings.filters_for(item.config, item),
        stray_warnings=settings.stray_warnings,
        runxfail=settings.runxfail,
        seed=seeds.for_test(settings.seed, item.nodeid),
    )


def _judged_attempts(
    adopter: Adopter,
    item: pytest.Item,
    spec: RankSpec,
    run_once: Callable[[tuple[Any, ...]], list[RankOutcome]],
    args: tuple[Any, ...],
    judged_by: Judge | None,
) -> None:
    """The adopter's attempts at `item` under the harness's bound (pytest-timeout's paused),
    then the one sequence after a body, judged by `judged_by` (the harness's by default)."""
    with timeout_interop.pytest_timeout_paused(item):
        outcomes = adopter.attempts(item, run_once, args)
    runner.after_body(item, spec, outcomes, judged_by=judged_by)


def run_adopted(
    item: pytest.Item, spec: RankSpec, entry: Callable[..., Any], args: tuple[Any, ...]
) -> list[RankOutcome]:
    """`entry(*args, rank=r)` on every warm rank of `spec`, after the ranks imported the
    module of `args[0]` (the class's Target) under the import's own bound. The harness's
    timer bounds the ranks; the caller pauses pytest-timeout's (see timeout_interop: it
    bounds the class's own set-up and tear-down here around them)."""
    case: Target = args[0]
    own = seam.own_ranks_of(item.config)
    outcomes = own.import_ahead(item, spec, case)
    if all(o.ok for o in outcomes):
        target = packing.function_target(entry)
        outcomes = own.run_target(spec, target, encode_args(args, {"rank": None}))
    return outcomes


def note_not_adopted(config: pytest.Config, where: str, why: str) -> None:
    """One line in the session's summary: `where` (a class, a test) runs as before, and why."""
    _summary(config).not_adopted.setdefault(where, why)
