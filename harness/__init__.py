"""harness: a pytest plugin that runs tests on real torch.distributed ranks.

Load it with ``pytest -p harness`` (or let the ``pytest11`` entry point load it). Mark a test
``@pytest.mark.ranks`` to run its body on every rank, or ask for the ``run_on_ranks`` fixture
to run a function on the ranks and inspect every rank's outcome from the pytest process.

Importing this package does not import torch; the ranks start when a test first needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.adopt.core import Adopter
    from harness.adopt.pool import RankPool, RankPoolError
    from harness.adopt.spawn import spawn
    from harness.common.assertions import assert_close_across_ranks, assert_on_all_ranks
    from harness.common.expect import Expected, aborts, exits, hangs, killed, raises, returns
    from harness.common.faults import Fault, fault_point
    from harness.common.outcome import Ending, RankOutcome
    from harness.pytest_side.run_on_ranks import RankRunner, WorldOutcome
    from harness.pytest_side.runner import RanksReplacedWarning
    from harness.simulation.collective_log import CollectiveLog, CollectiveRecord
    from harness.simulation.fake_world import FakeWorld
    from harness.simulation.fixtures import ThreadedWorldError
    from harness.simulation.threaded_world import ThreadRank

__all__ = [
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

# Every name, imported on first use: pytest must import the plugin modules itself (after
# marking them for assertion rewriting), or it warns, and a project with filterwarnings =
# error cannot start when the entry point loads this package; and a session with the plugin
# off (-p no:harness) imports only its hint (harness.off_hint), not the harness.
_LAZY = {
    "assert_close_across_ranks": "harness.common.assertions",
    "assert_on_all_ranks": "harness.common.assertions",
    "Expected": "harness.common.expect",
    "aborts": "harness.common.expect",
    "exits": "harness.common.expect",
    "hangs": "harness.common.expect",
    "killed": "harness.common.expect",
    "raises": "harness.common.expect",
    "returns": "harness.common.expect",
    "Fault": "harness.common.faults",
    "fault_point": "harness.common.faults",
    "Ending": "harness.common.outcome",
    "RankOutcome": "harness.common.outcome",
    "RankRunner": "harness.pytest_side.run_on_ranks",
    "WorldOutcome": "harness.pytest_side.run_on_ranks",
    "RanksReplacedWarning": "harness.pytest_side.runner",
    "Adopter": "harness.adopt.core",
    "ThreadedWorldError": "harness.simulation.fixtures",
    "CollectiveLog": "harness.simulation.collective_log",
    "CollectiveRecord": "harness.simulation.collective_log",
    "FakeWorld": "harness.simulation.fake_world",
    "ThreadRank": "harness.simulation.threaded_world",
    "RankPool": "harness.adopt.pool",
    "RankPoolError": "harness.adopt.pool",
    "spawn": "harness.adopt.spawn",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the distribution's (rankwise, which ships the harness)
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("rankwise")
        except PackageNotFoundError:  # imported from a source tree nobody installed
            return "0+unknown"
    if name not in _LAZY:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# pytest registers these (hooks and fixtures) when it registers this module.
pytest_plugins = [
    "harness.plugin",
    "harness.simulation.fixtures",
    "harness.adopt.core",
    "harness.adopt.spawn",
    "harness.adopt.pool",
    "harness.launched.reports",
]
