"""The harness's public names: sorted, documented, and pinned."""

from __future__ import annotations

import pytest

import harness

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast

HARNESS_NAMES = [
    "Adopter",
    "CollectiveLog",
    "CollectiveRecord",
    "Ending",
    "Expected",
    "FakeWorld",
    "Fault",
    "RankOutcome",
    "RankPool",
    "RankPoolError",
    "RankRunner",
    "RanksReplacedWarning",
    "ThreadRank",
    "ThreadedWorldError",
    "WorldOutcome",
    "aborts",
    "assert_close_across_ranks",
    "assert_on_all_ranks",
    "exits",
    "fault_point",
    "hangs",
    "killed",
    "raises",
    "returns",
    "spawn",
]


def test_harness_exports_are_sorted_and_documented() -> None:
    assert harness.__all__ == sorted(harness.__all__)
    assert all(getattr(harness, name).__doc__ for name in harness.__all__)
    assert harness.__all__ == HARNESS_NAMES
