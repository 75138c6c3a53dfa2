"""The ``rank_pool`` fixture and :class:`RankPool`: warm ranks that keep one process group
between calls, the drop-in for a hand-written pool of N processes a project keeps for its
session.

A pytest plugin module (it provides the fixture); runs from the pytest process of the
current session. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from harness import seam
from harness.adopt import ranks
from harness.adopt.spawn import RUN_HYGIENE, after_import, encoded_args, nprocs_value, target_of
from harness.common import rank_warnings
from harness.common.outcome import RankOutcome
from harness.common.protocol import RankSpec
from harness.common.report_text import failure_text
from harness.plan import packing, seeds
from harness.plan.settings import settings_of, timeout_for
from harness.pytest_side import runner


class RankPoolError(AssertionError):
    """A :meth:`RankPool.run` call failed on some rank; the message is the harness's report."""

    def __init__(self, report: str, outcomes: list[RankOutcome]) -> None:
        super().__init__(report)
        self.outcomes = outcomes


class RankPool:
    """Warm ranks that each call of :meth:`run` uses with a working process group.

    The replacement for a hand-written session pool of N processes: the rank processes stay
    (module state persists between calls) and so does the group after a clean call (gloo);
    a call that fails or hangs raises the report while the next call finds healthy ranks and
    a fresh, working group: a dead or hung rank is replaced first.
    """

    def __init__(
        self, config: pytest.Config, world_size: int | None = None, timeout: float | None = None
    ) -> None:
        settings = settings_of(config)
        self._config = config
        self.world_size = (
            settings.ranks
            if world_size is None
            else nprocs_value(world_size, "RankPool(world_size=...)")
        )
        self._spec = RankSpec(
            world_size=self.world_size,
            timeout_s=timeout_for(settings, timeout, "RankPool(timeout=...)"),
            backend=settings.backend,
            start_method=settings.start_method,
            hygiene=RUN_HYGIENE,
            warning_filters=rank_warnings.filters_for(config, None),
            stray_warnings=settings.stray_warnings,
            runxfail=settings.runxfail,
            seed=seeds.for_test(settings.seed, ""),  # the session's pool: one seed for it
        )

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(rank, world_size, *args, **kwargs)`` on every rank; each rank's value, in order.

        Raises :class:`RankPoolError` (an AssertionError) with the report, root cause first,
        when any rank raised, exited, died or hung.
        """
        blob = encoded_args(
            "rank_pool.run",
            (target_of(fn, "rank_pool.run"), args, kwargs),
            {"rank": None, "world_size": None},
        )
        target = packing.function_target(ranks.run_pooled)
        outcomes = after_import(
            self._config,
            self._spec,
            fn,
            lambda: seam.own_ranks_of(self._config).run_target(self._spec, target, blob),
        )
        rank_warnings.reemit(outcomes)
        report = failure_text(outcomes) or runner.leftovers_text(outcomes)
        if report is not None:
            raise RankPoolError(report, outcomes)
        return [o.value for o in outcomes]


@pytest.fixture(scope="session")
def rank_pool(pytestconfig: pytest.Config) -> RankPool:
    """A pool of --ranks warm ranks: ``rank_pool.run(fn, *args)`` calls
    ``fn(rank, world_size, *args)`` on each inside a process group, and returns their values.
    """
    return RankPool(pytestconfig)
