"""`run_on_ranks`: any module-level function on the session's ranks, from the pytest process,
and every rank's outcome back (WorldOutcome) to assert on.

Loaded with the plugin; imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from harness.common import expect as expectations
from harness.common import rank_warnings
from harness.common.faults import Fault
from harness.common.outcome import Ending, RankOutcome
from harness.common.report_text import failure_text
from harness.plan import packing
from harness.plan.settings import settings_of
from harness.plan.specs import spec_for_call
from harness.pytest_side.verdict import note_missed_faults
from harness.seam import own_ranks_of, ranks_of


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
        packing.function_target(fn)  # a module-level function, whichever ranks run it
        settings = settings_of(self._config)
        spec = spec_for_call(
            self._config, settings, self._node, world_size, timeout, launch, backend, faults
        )
        # Outside a test (a session fixture's call) the launch has no test to agree on: such
        # a call runs on warm ranks, as in a plain session.
        ranks = ranks_of(self._config) if self._node is not None else own_ranks_of(self._config)
        outcomes = ranks.run_call(self._node, spec, fn, args, kwargs)
        rank_warnings.reemit(outcomes)
        note_missed_faults(self._node, outcomes)
        return WorldOutcome(outcomes)
