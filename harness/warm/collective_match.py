"""Collectives the ranks of a test called differently on the harness's group, and whose.

Each warm rank keeps, in shared memory, the fingerprint of every collective it calls on the
group the harness set up (its name as torch.distributed calls it, the shape and dtype of its
first tensor; see rank/kept_group.py). gloo runs mismatched collectives without a word when
their sizes happen to fit (an all_reduce of [2] against one of [1] let the other ranks
return unreduced data) or leaves one rank waiting: the pytest side compares the ranks'
collectives in order and names the rank that called something else, before it names the
ones that returned. Reads no torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.common.outcome import RankOutcome

MISMATCH_TYPE = "harness.CollectiveMismatch"


@dataclass(frozen=True)
class Mismatch:
    """The first collective the ranks called differently."""

    index: int  # its place among each rank's collectives on the group, from 0
    called: dict[int, str]  # every rank's fingerprint of it
    common: str  # what most ranks called ("" when no fingerprint has a majority)

    @property
    def odd(self) -> list[int]:
        """The ranks that called something else than most (every rank differing from rank
        0's call when there is no majority, as with two ranks)."""
        usual = self.common or self.called[min(self.called)]
        return sorted(r for r, fp in self.called.items() if fp != usual)

    def sentence(self, rank: int) -> str:
        """What `rank` called against what the others did, for its report."""
        usual = self.common or self.called[min(self.called)]
        alike = sorted(r for r, fp in self.called.items() if fp == usual)
        text = (
            f"called {_described(self.called[rank], full=True)} as collective {self.index + 1} "
            f"on the group; {_ranks(alike)} called {_described(usual, full=False)}"
        )
        if not self.common:
            text += " (no call has a majority, so which rank is wrong cannot be told)"
        return text + (
            ": every rank must call the same collectives, in the same order, on tensors of "
            "the same shape and dtype (an uneven last batch, a rank skipping a step?)"
        )


def first_mismatch(
    boards: dict[int, tuple[int, dict[int, str]]], since: int = 0
) -> Mismatch | None:
    """The first collective every rank has called and not all alike, from each rank's
    (count, fingerprints by index) board, looking from index `since` on (those before were
    compared already); None when they agree so far."""
    if len(boards) < 2:
        return None
    reached = min(count for count, _ in boards.values())
    for index in range(since, reached):
        called = {r: kept[index] for r, (_, kept) in boards.items() if index in kept}
        if len(called) < len(boards) or len(set(called.values())) == 1:
            continue  # older than some rank's board keeps, or alike
        (top, most), *rest = Counter(called.values()).most_common()
        common = top if not rest or rest[0][1] < most else ""
        return Mismatch(index, called, common)
    return None


def blame(mismatch: Mismatch, outcomes: dict[int, RankOutcome]) -> None:
    """Make each odd rank's outcome the failure that names its call (the root cause, as
    it came first); what the rank did after is kept in a note."""
    from harness.common.outcome import Ending

    first = min((o.at for o in outcomes.values()), default=0.0)
    for rank in mismatch.odd:
        outcome = outcomes.get(rank)
        if outcome is None:
            continue
        if outcome.ending is not Ending.RETURNED:
            outcome = outcome.noted(f"after that, it {outcome.describe()}", first=True)
        outcomes[rank] = outcome.raised_instead(
            MISMATCH_TYPE,
            ("CollectiveMismatch", "Exception"),
            mismatch.sentence(rank),
            at=first - 1e-6,  # before whatever the mismatch caused on its peers
        )


def _described(fingerprint: str, full: bool) -> str:
    """'all_reduce on a tensor of shape [2] (float32)' (or, short: 'all_reduce on [2]
    (float32)') from 'all_reduce [2] float32'."""
    name, _, rest = fingerprint.partition(" ")
    if not rest:
        return name
    shape, _, dtype = rest.rpartition(" ")
    if not shape:
        return f"{name} on a tensor of {dtype}" if full else f"{name} on {dtype}"
    return (
        f"{name} on a tensor of shape {shape} ({dtype})" if full else f"{name} on {shape} ({dtype})"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
