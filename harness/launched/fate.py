"""What becomes of a launched session: the ranks it lost, why it stops, what its summary
adds, and the exit status every rank agreed on. Written as tests end, read by the reports,
the error files and the watch thread (which ends the process with the agreed status)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import pytest

from harness.common.report_text import ranks_phrase


@dataclass(frozen=True)
class FirstFailure:
    """The session's first failed test, as this rank reported it (for torchrun's summary)."""

    nodeid: str
    root: int  # the rank its report names first
    line: str  # what the report's first line says
    text: str  # this rank's report of it


class Fate:
    """The session's fate as this rank knows it."""

    def __init__(self) -> None:
        self.lost: dict[int, str] = {}  # ranks that cannot run another test, and why
        self.stop_reason = ""
        self.first_failure: FirstFailure | None = None
        # Under --continue-on-collection-errors: the other ranks' collection errors, which
        # this rank's report would not show (their own reports are quiet).
        self.peer_collection_errors: list[str] = []
        self.final_status: int | None = None
        self.finished = threading.Event()  # the exit status is agreed: the session is over

    def lose(self, ranks: Mapping[int, str]) -> None:
        """`ranks` cannot run another test, each for its reason (the latest word on it)."""
        self.lost.update(ranks)

    def lose_unless_known(self, rank: int, why: str) -> None:
        """`rank` cannot run another test; a reason known already stays."""
        self.lost.setdefault(rank, why)

    def lost_reasons(self) -> list[str]:
        """'ranks 2 and 3: why', the lost ranks grouped by their reason."""
        by_reason: dict[str, list[int]] = {}
        for rank, why in sorted(self.lost.items()):
            by_reason.setdefault(why, []).append(rank)
        return [f"{ranks_phrase(ranks)}: {why}" for why, ranks in by_reason.items()]

    def note_peer_collection_errors(self, errors: list[str]) -> None:
        """Another rank's collection errors, for this rank's report (theirs are quiet)."""
        self.peer_collection_errors.extend(errors)

    def note_failure(self, failure: FirstFailure) -> None:
        if self.first_failure is None:
            self.first_failure = failure

    def stop(self, reason: str, session: pytest.Session) -> None:
        """End the session after the current test: a rank cannot go on."""
        self.stop_reason = reason
        session.shouldfail = reason  # as -x does: the exit status says tests failed

    def over(self, status: int) -> None:
        """The exit status is agreed: from here the process exits with it on its own."""
        self.final_status = status
        self.finished.set()
