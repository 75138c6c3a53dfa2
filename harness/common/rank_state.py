"""What a warm rank's process holds after a run, beside its verdict: the group it kept for
the next test and what the pytest side checks before reusing it, and whether the rank must
settle a group the test made. The rank reports it with its outcome; the run loop and the
pools decide on it (drop the group, keep it, reuse it), and the verdict never reads it.

Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.common.outcome import RankOutcome

# Point-to-point messages on a kept group: (sent, received), each ((peer, tag, count), ...).
Messages = tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...]]


@dataclass
class RankState:
    """One rank's state after a run, for the next run on it."""

    kept_group: str | None = None  # the group this rank kept for the next test, if any
    # A group the test set up itself was torn down: this rank says whether it stays
    # (Kind.SETTLED), as it ends if something still holds the group (and its store's port).
    settles: bool = False
    # On the kept group since it was made: (sent, received) point-to-point messages by peer
    # and tag; None when a receive from any source hides who sent what.
    point_to_point: Messages | None = ((), ())
    # Its operation count and torch's count of named groups (kept_group.counts; None: torch
    # cannot tell); with the messages above, what the pytest side compares across ranks
    # before reusing the group.
    kept_counts: tuple[int, int] | None = None

    def give_group_up(self) -> None:
        """The group is not to be reused (the rank drops it, or is replaced)."""
        self.kept_group = None


@dataclass(frozen=True)
class RankResult:
    """What a warm rank sends back after a run: its verdict's outcome and its state."""

    outcome: RankOutcome
    state: RankState
