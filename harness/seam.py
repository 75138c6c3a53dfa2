"""Where a ranks test's body runs, behind one seam: the session's :class:`Ranks`.

Warm rank processes (``warm/session.py``'s ``WarmRanks``) are the default: the plugin puts
them in place at configure. Under torchrun the launch's plugin puts its own in their place:
this process is one of the ranks. ``runner`` runs and judges every test one way through
it, so what happens after a body (warnings, leftovers, output, the verdict) exists once.

Adopted suites, ``harness.spawn``, ``rank_pool`` and a session fixture's ``run_on_ranks`` call
run on rank processes this process starts itself, whatever the session: :class:`OwnRanks`
(warm ranks, ``own_ranks_of``), under a launch too.

Loaded with the plugin; imports no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, Protocol

import pytest

from harness.common.outcome import RankOutcome
from harness.common.protocol import RankSpec, Target


class Ranks(Protocol):
    """The ranks a session's tests run on: their set-up, a test's body, a run_on_ranks call,
    and the answers of the fixtures that differ per rank."""

    # Whether this process attaches the ranks' output to the report (under torchrun rank 0
    # reports for every rank, and a rank that speaks for a lost rank 0).
    @property
    def reports_output(self) -> bool: ...

    def set_up(
        self, item: pytest.Item, spec: RankSpec | None, gpu_marked: bool
    ) -> Generator[None, Any, Any]:
        """pytest_runtest_setup's wrapper body for a test (spec None: a test without ranks)."""
        ...

    @property
    def drives_examples(self) -> bool:
        """Whether a hypothesis search runs in this process, each example sent to the
        ranks (run_test with `drawn`); else each rank searches for itself."""
        ...

    def run_test(
        self, item: pytest.Function, spec: RankSpec, drawn: dict[str, Any] | None = None
    ) -> list[RankOutcome]:
        """The test's body on every rank: each rank's outcome, in rank order; with `drawn`,
        the test's own function (a hypothesis test's inner one) with those arguments too."""
        ...

    def run_call(
        self,
        node: pytest.Item | None,
        spec: RankSpec,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> list[RankOutcome]:
        """`fn(*args, **kwargs)` on every rank (run_on_ranks)."""
        ...

    def rank_here(self) -> int | None:
        """This process's rank, where it is one (None: the ranks are other processes)."""
        ...

    def device_here(self) -> Any:
        """This process's torch.device, where it is a rank (None otherwise)."""
        ...

    def shared_path(
        self, request: pytest.FixtureRequest, make: Callable[[], Path], timeout_s: float
    ) -> Path:
        """The test's shared_tmp_path: made by `make`, the same on every rank."""
        ...


class Cut:
    """A caller's handle to end a run early: at `at` (time.monotonic()) the ranks still
    running count as hung, with `why` in their note. A harness.spawn(join=False) run whose
    test failed while it ran: nobody will join it."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.why = ""
        self.asked_at = 0.0

    def after(self, seconds: float, why: str) -> None:
        """End the run as hung `seconds` from now unless it ends first."""
        now = time.monotonic()
        self.why, self.asked_at, self.at = why, now, now + seconds


class OwnRanks(Ranks, Protocol):
    """Rank processes this process starts itself: besides a test's body, any module-level
    target a caller packs (an adopted base's entry point, harness.spawn's function)."""

    def import_ahead(
        self, item: pytest.Item | None, spec: RankSpec, target: Target
    ) -> list[RankOutcome]:
        """The ranks for `spec` import `target`'s module under the import's own bound before
        `item` runs: empty when they have it (or imported it now), else every rank's
        outcome of the import (the run's failure)."""
        ...

    def run_target(
        self,
        spec: RankSpec,
        target: Target,
        args_blob: bytes,
        on_start: Callable[[list[int]], None] | None = None,
        cut: Cut | None = None,
    ) -> list[RankOutcome]:
        """`target` with the encoded (args, kwargs) on every rank for `spec`; `on_start` is
        told the rank processes as the run starts, `cut` may end it early."""
        ...

    def failure_grace_s(self) -> float:
        """How long the peers of a failed rank get to finish before they count as hung."""
        ...

    def take_start_output(
        self, item: pytest.Item
    ) -> tuple[str, tuple[str, list[RankOutcome]] | None]:
        """What starting the ranks printed before `item`, once: the fork server's preload of
        the tests' imports (or ""), and the module the ranks imported for `item` with each
        rank's outcome (None when they had it already)."""
        ...


_ranks_key = pytest.StashKey[Ranks]()
_own_key = pytest.StashKey[OwnRanks]()


def ranks_of(config: pytest.Config) -> Ranks:
    """The session's ranks: the launch's where the session is one, else warm rank processes."""
    return config.stash[_ranks_key]


def use(config: pytest.Config, ranks: Ranks) -> None:
    """Run the session's tests on `ranks`: the plugin puts warm ranks in place at configure,
    and a launch's plugin its own after it."""
    config.stash[_ranks_key] = ranks


def use_own(config: pytest.Config, ranks: OwnRanks) -> None:
    """The rank processes this process starts itself (the plugin's warm ranks, at configure)."""
    config.stash[_own_key] = ranks


def own_ranks_of(config: pytest.Config) -> OwnRanks:
    """The rank processes this process starts itself, whatever the session's tests run on."""
    return config.stash[_own_key]


def skip_without_gpus(needed: int) -> None:
    """Skip the current test, at its own location, when fewer than `needed` GPUs are here."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        raise pytest.skip.Exception(
            f"needs {needed} CUDA GPU(s), this machine has {have}", _use_item_location=True
        )
