"""Which rank's failure is the root cause, which are collateral, and which failed on their
own: read from every rank's outcome (and what each was expected to do). The report's words
are report_text.py's.

Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from harness.common.outcome import Ending, RankOutcome


@dataclass(frozen=True)
class Diagnosis:
    """Which rank's failure came first and which failures it caused.

    Two cases have no failing root: ranks that `departed` (returned, or tore their group
    down) while the failing ranks waited on them, and ranks hung `out_of_step` (each in a
    different collective, every one waiting for the others).
    """

    root: int | None
    collateral: tuple[int, ...]
    independent: tuple[int, ...]  # failed on their own account, after the root cause
    departed: tuple[int, ...] = ()  # returned while the collateral ranks waited; root first
    out_of_step: tuple[int, ...] = ()


def diagnose(outcomes: Sequence[RankOutcome], failed: Sequence[int]) -> Diagnosis:
    """Pick the root cause among the `failed` ranks: the first in time that a peer did not cause."""
    if not failed:
        return Diagnosis(None, (), ())
    by_rank = {o.rank: o for o in outcomes}
    primary = [r for r in failed if not by_rank[r].looks_collateral]
    if not primary:
        found = _out_of_step(by_rank, failed) or _departed(outcomes, by_rank, failed)
        if found is not None:
            return found
    pool = primary or list(failed)
    # A hang's time is the deadline it was found at, not when it began: a node lost before
    # then (its ranks silent, or the store gone) is the cause ranks waiting on it hung for.
    lost = any(by_rank[r].ending is Ending.LOST for r in pool)
    root = min(pool, key=lambda r: (lost and by_rank[r].ending is Ending.HUNG, by_rank[r].at, r))
    rest = [r for r in failed if r != root]
    collateral = tuple(r for r in rest if r not in primary)
    independent = tuple(r for r in rest if r in primary)
    return Diagnosis(root, collateral, independent)


def _out_of_step(by_rank: dict[int, RankOutcome], failed: Sequence[int]) -> Diagnosis | None:
    """Every failed rank hung, each in a collective, and not all in the same one."""
    hung = [by_rank[r] for r in failed]
    if not all(o.ending is Ending.HUNG and o.in_collective for o in hung):
        return None
    if len({o.in_collective for o in hung}) < 2:
        return None
    return Diagnosis(None, (), (), out_of_step=tuple(failed))


def _departed(
    outcomes: Sequence[RankOutcome], by_rank: dict[int, RankOutcome], failed: Sequence[int]
) -> Diagnosis | None:
    """Ranks that returned while every failure was peer-caused: the peers waited on them.

    The side with fewer ranks is the odd one out: ranks that returned while as many or more
    waited forgot the collective (the first of them is the root cause); a rank that waits
    while more ranks returned called one that no other did (it is the root cause). Not
    ordered by time: a rank that tore its group down reports its return after the peers'
    errors that the teardown caused.
    """
    left = sorted(
        (o for o in outcomes if o.ending is Ending.RETURNED and o.rank not in failed),
        key=lambda o: (o.at, o.rank),
    )
    if not left:
        return None
    departed = tuple(o.rank for o in left)
    if len(left) > len(failed):
        return Diagnosis(failed[0], tuple(failed[1:]), (), departed=departed)
    return Diagnosis(left[0].rank, tuple(failed), (), departed=departed)


class Expectation(Protocol):
    """One rank's expected end, as harness.common.expect.Expected provides it."""

    def matches(self, got: RankOutcome) -> bool: ...
    def describe(self) -> str: ...


def failed_ranks(
    outcomes: Sequence[RankOutcome], expected: Sequence[Expectation] = ()
) -> list[int]:
    """The ranks that did not end as `expected` (default: every rank returns)."""
    if expected:
        return [o.rank for o in outcomes if not expected[o.rank].matches(o)]
    return [o.rank for o in outcomes if not o.ok]


def root_cause(
    outcomes: Sequence[RankOutcome], expected: Sequence[Expectation] = ()
) -> RankOutcome | None:
    """The rank the failure report puts first; None when every rank ended as expected, or
    no one rank is to blame (ranks out of step)."""
    failed = failed_ranks(outcomes, expected)
    root = diagnose(outcomes, failed).root if failed else None
    return next((o for o in outcomes if o.rank == root), None)
