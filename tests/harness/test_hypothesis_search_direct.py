"""hypothesis's search for a ranks test, tested directly with a fake item (no ranks, no
process): every example it draws goes to the ranks' runner and is judged there, a failing
one is shrunk by hypothesis and raised once, and the settings the harness gives the search
(no deadline, no explain phase) leave the test's own in place."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("hypothesis")
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from harness.plan import hypothesis_search

pytestmark = pytest.mark.unit


def _item(fn: Any) -> Any:
    info = SimpleNamespace(argnames=("rank",), name2fixturedefs={})
    return SimpleNamespace(obj=fn, _fixtureinfo=info, funcargs={"rank": 0})


def test_every_drawn_example_goes_to_the_ranks_and_a_failing_one_is_shrunk() -> None:
    @settings(max_examples=30, database=None, derandomize=True)
    @given(n=st.integers(0, 100))
    def test_n(rank: int, n: int) -> None:
        raise AssertionError("the ranks run it, never this process")

    item, drawn = _item(test_n), []

    def run_example(example: dict[str, Any]) -> list[Any]:
        drawn.append(example)
        return [example["n"]]

    def judge(outcomes: list[Any]) -> None:
        if outcomes[0] >= 7:
            raise AssertionError(f"rank 1 failed with n={outcomes[0]}")

    assert hypothesis_search.is_search(item)
    with pytest.raises(AssertionError, match=r"^rank 1 failed with n=7\n"):
        hypothesis_search.search(item, run_example, judge)
    assert drawn and all(set(d) == {"n"} for d in drawn)  # the fixtures stay out
    assert drawn[-1] == {"n": 7}  # hypothesis replays its shrunk example last
    assert test_n.hypothesis.inner_test.__name__ == "test_n"  # given back as it was


def test_the_search_has_no_deadline_nor_explain_phase_and_keeps_the_tests_settings() -> None:
    @settings(max_examples=3, deadline=200)
    @given(n=st.integers())
    def test_n(rank: int, n: int) -> None: ...

    item = _item(test_n)
    hypothesis_search.prepare(item, fixtures_per_example=False)
    made: Any = test_n._hypothesis_internal_use_settings  # type: ignore[attr-defined]
    assert made.deadline is None and made.max_examples == 3
    assert Phase.explain not in made.phases


def test_a_plain_function_is_no_search() -> None:
    assert not hypothesis_search.is_search(_item(lambda rank: None))
