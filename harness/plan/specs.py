"""Each test's spec from its markers (``@pytest.mark.ranks`` with fault, expect and
allow_leftovers), and a run_on_ranks call's from its arguments, over the session's
settings. Testable without starting a process; imports no torch.

A bad marker is that test's error only: :func:`spec_for` raises :class:`SpecError` and the
plugin reports it when the test is set up, so a typo in one test never stops the others.
"""

from __future__ import annotations

import unittest
from typing import Any

import pytest

from harness.common import expect as expectations
from harness.common import faults as fault_specs
from harness.common import hygiene, rank_warnings
from harness.common.errors import SpecError, invalid
from harness.common.protocol import RankSpec
from harness.plan import seeds
from harness.plan.settings import (
    Settings,
    backend_value,
    flag_value,
    launch_value,
    timeout_for,
    world_size_value,
)

WORLD_PARAM = "_harness_world_size"
RANKS_OPTIONS = ("timeout", "launch", "backend", "fresh_group", "same_seed")
# Markers that only mean something on a ranks test.
RANK_TEST_MARKERS = ("fault", "expect", "allow_leftovers")
# Where a ranks test's spec is kept (its items' stash), or the error its markers are.
SPEC_KEY = pytest.StashKey[RankSpec]()
SPEC_ERROR_KEY = pytest.StashKey[str]()


# ---- a test's spec from its markers -------------------------------------------------------


def marked_sizes(item: pytest.Item | pytest.Function, mark: pytest.Mark) -> list[int]:
    """The world sizes `@pytest.mark.ranks(2, 4)` asks for; SpecError for a bad one, or for
    ranks markers stacked on the test itself (only the closest would apply)."""
    origin = f"@pytest.mark.ranks on {item.nodeid}"
    stacked = [m for m in item.own_markers if m.name == "ranks"]
    if len(stacked) > 1:
        shown = ", ".join(_shown_marker(m) for m in reversed(stacked))  # as written, top down
        every = sorted({size for m in stacked for size in m.args}, key=str)
        raise SpecError(
            f"{origin} has {len(stacked)} ranks markers ({shown}), of which only one would "
            f"apply: give one, with every world size to run it at "
            f"(ranks({', '.join(map(str, every))}))"
        )
    return [world_size_value(size, origin) for size in mark.args]


def _shown_marker(mark: pytest.Mark) -> str:
    args = [repr(a) for a in mark.args] + [f"{k}={v!r}" for k, v in mark.kwargs.items()]
    return f"{mark.name}({', '.join(args)})"


def spec_for(item: pytest.Function, settings: Settings) -> RankSpec:
    """How a ranks-marked test runs; SpecError naming the marker, the test and the fix."""
    mark = item.get_closest_marker("ranks")
    assert mark is not None, item.nodeid
    origin = f"@pytest.mark.ranks on {item.nodeid}"
    if item.cls is not None and issubclass(item.cls, unittest.TestCase):
        raise SpecError(
            f"{origin} cannot run a unittest.TestCase method on ranks (unittest runs it "
            f"itself, in the pytest process): make it a test function or a plain test class; "
            f"a torch MultiProcessTestCase suite runs on ranks with --rank-adopt torch"
        )
    unknown = set(mark.kwargs) - set(RANKS_OPTIONS)
    if unknown:
        raise SpecError(
            invalid(
                "option(s)",
                sorted(unknown),
                origin,
                "use timeout=, launch=, backend=, fresh_group= or same_seed=",
            )
        )
    world_size = _world_size_of(item, mark, settings)
    backend = mark.kwargs.get("backend")
    return RankSpec(
        world_size=world_size,
        timeout_s=timeout_for(settings, mark.kwargs.get("timeout"), origin, item),
        backend=settings.backend if backend is None else backend_value(backend, origin),
        start_method=settings.start_method,
        launch=launch_value(mark.kwargs.get("launch", False), origin),
        fresh_group=settings.fresh_group or flag_value("fresh_group", mark, origin),
        collective_check=settings.collective_check,
        faults=_marked_faults(item, world_size),
        expected=_marked_expectations(item, world_size),
        hygiene=frozenset(hygiene.CHECKS) - _allowed_leftovers(item),
        warning_filters=rank_warnings.filters_for(item.config, item),
        threads=settings.threads_for(world_size),
        assert_verbosity=settings.assert_verbosity,
        log_capture=settings.log_capture,
        show_locals=settings.show_locals,
        stray_warnings=settings.stray_warnings,
        runxfail=settings.runxfail,
        keep_value=False,  # a test's value only warns: its repr is enough
        seed=seeds.for_test(settings.seed, item.nodeid),
        same_seed=flag_value("same_seed", mark, origin),
    )


def _world_size_of(item: pytest.Function, mark: pytest.Mark, settings: Settings) -> int:
    marked_sizes(item, mark)  # checked again: a bad size left the test unparametrized
    callspec = getattr(item, "callspec", None)
    if callspec is not None and WORLD_PARAM in callspec.params:
        return int(callspec.params[WORLD_PARAM])
    return settings.ranks


def stray_marker(item: pytest.Item) -> str | None:
    """The error for a fault/expect/allow_leftovers marker on a test without ranks, or None."""
    if item.get_closest_marker("ranks") is not None:
        return None
    for name in RANK_TEST_MARKERS:
        if item.get_closest_marker(name) is not None:
            return (
                f"the {name} marker on {item.nodeid} applies only to a test marked "
                f"@pytest.mark.ranks: add @pytest.mark.ranks(N), or remove the {name} marker"
            )
    return None


def _marked_faults(item: pytest.Function, world_size: int) -> tuple[fault_specs.Fault, ...]:
    origin = f"the fault marker on {item.nodeid}"
    found: list[fault_specs.Fault] = []
    for mark in item.iter_markers("fault"):
        try:
            found += fault_specs.from_marker(mark.args, mark.kwargs)
        except (TypeError, fault_specs.FaultError) as exc:
            raise fault_specs.FaultError(f"{exc}, in {origin}") from None
    return tuple(fault_specs.validate(f, world_size, origin) for f in found)


def _marked_expectations(
    item: pytest.Function, world_size: int
) -> tuple[expectations.Expected, ...]:
    mark = item.get_closest_marker("expect")
    if mark is None:
        return ()
    origin = f"the expect marker on {item.nodeid}"
    return tuple(expectations.from_marker(mark.args, mark.kwargs, world_size, origin))


def _allowed_leftovers(item: pytest.Function) -> frozenset[str]:
    mark = item.get_closest_marker("allow_leftovers")
    if mark is None:
        return frozenset()
    return hygiene.parse_allowed(mark.args, f"the allow_leftovers marker on {item.nodeid}")


# ---- run_on_ranks's arguments -------------------------------------------------------------


def spec_for_call(
    config: pytest.Config,
    settings: Settings,
    node: pytest.Item | None,
    world_size: int | None,
    timeout: float | None,
    launch: bool,
    backend: str | None,
    faults: Any,
) -> RankSpec:
    """The spec of one run_on_ranks call; SpecError (a ValueError) naming the argument."""
    size = world_size_value(
        world_size if world_size is not None else settings.ranks, "run_on_ranks(world_size=...)"
    )
    return RankSpec(
        world_size=size,
        timeout_s=timeout_for(settings, timeout, "run_on_ranks(timeout=...)", node),
        backend=settings.backend
        if backend is None
        else backend_value(backend, "run_on_ranks(backend=...)"),
        start_method=settings.start_method,
        launch=launch_value(launch, "run_on_ranks(launch=...)"),
        faults=tuple(fault_specs.validate(f, size, "run_on_ranks(faults=...)") for f in faults),
        warning_filters=rank_warnings.filters_for(config, node),
        threads=settings.threads_for(size),
        fresh_group=settings.fresh_group,
        collective_check=settings.collective_check,
        assert_verbosity=settings.assert_verbosity,
        show_locals=settings.show_locals,
        stray_warnings=settings.stray_warnings,
        runxfail=settings.runxfail,
        seed=seeds.for_test(settings.seed, node.nodeid if node is not None else ""),
    )
