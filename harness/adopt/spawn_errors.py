"""The exceptions :func:`harness.spawn` raises: torch's own spawn exception types, extended.

A helper written for ``torch.multiprocessing.spawn`` catches ``ProcessRaisedException`` or
``ProcessExitedException`` (or matches their message); these subclasses keep both, and carry
the harness's report (every rank's end, root cause first) and the outcomes. Imports torch:
loaded only when a spawned run failed.
"""

from __future__ import annotations

from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from harness.common.outcome import RankOutcome


class RankRaised(ProcessRaisedException):
    """A rank raised: torch's message and traceback first, then the harness's report."""

    report: str = ""
    outcomes: list[RankOutcome] = []  # noqa: RUF012 - set per instance when raised


class RankExited(ProcessExitedException):
    """A rank exited, died of a signal or hung: torch's first line, then the harness's report."""

    report: str = ""
    outcomes: list[RankOutcome] = []  # noqa: RUF012 - set per instance when raised
