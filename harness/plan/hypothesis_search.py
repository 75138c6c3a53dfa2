"""hypothesis's `@given` on a ranks test: the search runs in the pytest process, and every
example it draws runs on every rank, so that every rank runs the same examples in the same
order, and one database is written (this process's).

hypothesis calls the test's inner function once per example with the drawn values; here
that call sends the example to the warm ranks (a run of the test's own function, unwrapped,
with the drawn values) and judges every rank's end as any ranks test's: a failing example
fails with the harness's report, which hypothesis shrinks and reports once, with its
falsifying example. The ranks are seeded per example as per test (seeds.py), so replaying
an example replays it exactly.

What differs from a plain test (docs/harness.md, "Plugins in CI"): hypothesis's deadline is
off (an example's time includes the ranks' run: the harness's bound is the test's), and its
function-scoped-fixture health check passes fixtures the ranks make for every example
(`rank`, `device`, `tmp_path`, those using them) and the world's constants (`world_size`).
Under torchrun each launched rank runs the search itself, seeded alike from the session
seed, and only rank 0 keeps a database.

Imports hypothesis only where the test module did.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness.common.outcome import RankOutcome
from harness.plan import made_in_ranks, seeds
from harness.plan.settings import settings_of

# Fixtures whose value holds for every example of a test: constants of the world.
SAME_FOR_EVERY_EXAMPLE = frozenset({"rank", "world_size", "device"})


def is_search(item: pytest.Item) -> bool:
    """Whether `item`'s function is a hypothesis test (`@given`)."""
    obj = getattr(item, "obj", None)
    return "hypothesis" in sys.modules and bool(getattr(obj, "is_hypothesis_test", False))


def prepare(item: pytest.Function, fixtures_per_example: bool) -> None:
    """Before hypothesis's own checks of `item` run: no deadline, and the health check of
    function-scoped fixtures passing those made anew for every example (on warm ranks, those
    the ranks make: `fixtures_per_example`) and the world's constants."""
    if not is_search(item):
        return
    from hypothesis import HealthCheck, Phase
    from hypothesis import settings as Settings

    fn: Any = getattr(item.obj, "__func__", item.obj)
    current: Any = getattr(fn, "_hypothesis_internal_use_settings", None) or Settings.default
    suppressed = set(current.suppress_health_check)
    if _fixtures_fresh_for_every_example(item, fixtures_per_example):
        suppressed.add(HealthCheck.function_scoped_fixture)
    # hypothesis's own pytest plugin adjusts a parametrized test's settings the same way.
    # Its explain phase traces this process's lines, the harness's, not the test's (the
    # test's run in the ranks): left out.
    phases = tuple(phase for phase in current.phases if phase is not Phase.explain)
    fn._hypothesis_internal_use_settings = Settings(
        parent=current, deadline=None, suppress_health_check=suppressed, phases=phases
    )


def _fixtures_fresh_for_every_example(item: pytest.Function, per_example: bool) -> bool:
    """Whether each function-scoped fixture the test asks for is made anew in the ranks for
    every example (`per_example`), or the same for all (the world's constants)."""
    made = made_in_ranks.made_for(item) if per_example else frozenset()
    fresh = made | SAME_FOR_EVERY_EXAMPLE
    defs = item._fixtureinfo.name2fixturedefs
    for name in item._fixtureinfo.argnames:
        chain = defs.get(name, ())
        if chain and chain[-1].scope == "function" and name not in fresh:
            return False
    return True


def seed_in_process(item: pytest.Function) -> None:
    """Under torchrun (every rank searches for itself): the same seed on every rank, from
    the session's, and a database on rank 0 only."""
    if not is_search(item):
        return
    fn: Any = getattr(item.obj, "__func__", item.obj)
    seed = seeds.for_test(settings_of(item.config).seed, item.nodeid)
    fn._hypothesis_internal_use_seed = seed % 2**32
    launched = settings_of(item.config).launched
    if launched is not None and launched.rank != 0:
        from hypothesis import settings as Settings

        current: Any = getattr(fn, "_hypothesis_internal_use_settings", None) or Settings.default
        fn._hypothesis_internal_use_settings = Settings(parent=current, database=None)


Example = Callable[[dict[str, Any]], list[RankOutcome]]


def search(
    item: pytest.Function, run_example: Example, judge: Callable[[list[RankOutcome]], None]
) -> list[RankOutcome]:
    """Run hypothesis's search for `item` here, each example through `run_example` (every
    rank's outcome of it), judged by `judge` (raising for a failing example); the last
    example's outcomes (hypothesis's final replay of a failure, or the last passing one)."""
    argnames = set(item._fixtureinfo.argnames)
    last: list[list[RankOutcome]] = [[]]

    def on_ranks(*args: Any, **kwargs: Any) -> None:
        drawn = {name: value for name, value in kwargs.items() if name not in argnames}
        last[0] = run_example(drawn)
        judge(last[0])

    original = item.obj.hypothesis.inner_test
    on_ranks.__name__, on_ranks.__qualname__ = original.__name__, original.__qualname__
    with _inner_test(item, on_ranks):
        item.obj(**{name: item.funcargs[name] for name in argnames})
    return last[0]


@contextlib.contextmanager
def _inner_test(item: pytest.Function, inner: Callable[..., None]) -> Iterator[None]:
    """hypothesis's inner test of `item` replaced by `inner` while the search runs (the way
    plugins that run tests elsewhere hook it)."""
    handle = item.obj.hypothesis
    original = handle.inner_test
    handle.inner_test = inner
    try:
        yield
    finally:
        handle.inner_test = original
