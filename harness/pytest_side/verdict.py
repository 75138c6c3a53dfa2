"""The verdict on a ranks test from every rank's outcome, as pytest would give a plain test's:
pass only if every rank ended as expected; a skip or an xfail on every rank skips or xfails
it; `xfail(raises=E)` is checked against each rank's own failure; a fault that never fired
is never xfailed. The failure text names the root cause first (common/outcome.py).

Loaded with the plugin; imports no torch.
"""

from __future__ import annotations

import contextlib
from typing import TypeGuard

import pytest

from harness.common import expect as expectations
from harness.common.errors import HarnessError
from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import RankSpec
from harness.common.report_text import ReportStyle, failure_text, ranks_phrase, set_up_failure_text
from harness.common.root_cause import diagnose, failed_ranks
from harness.plan.settings import settings_of
from harness.seam import ranks_of

# Set when a rank's fault never fired: the test is written wrong, which no xfail expects.
_no_xfail_key = pytest.StashKey[bool]()
FAULT_NOT_REACHED = "harness.common.faults.FaultNotReached"


def judge(item: pytest.Item, spec: RankSpec, outcomes: list[RankOutcome]) -> None:
    """Pass only if every rank ended as expected; otherwise fail with the root cause first.

    pytest's own outcomes raised in ranks count as in a plain test: a skip or an xfail on
    every rank (the others returning, for an xfail) skips or xfails the test.
    """
    if all(o.setup_failed for o in outcomes):
        raise HarnessError(set_up_failure_text(outcomes), pytrace=False)
    if all(o.ending is Ending.SKIPPED for o in outcomes):  # reported where rank 0 skipped
        if outcomes[0].skipped_at is not None:
            item.stash[_skipped_at_key] = outcomes[0].skipped_at
        raise pytest.skip.Exception(outcomes[0].message, _use_item_location=True)
    note_missed_faults(item, outcomes)
    _xfail_if_ranks_did(outcomes)
    _fail_a_partial_skip(outcomes)
    style = ReportStyle(
        verbose=item.config.getoption("verbose", 0) > 0,
        streams=not ranks_of(item.config).reports_output,  # else pytest shows them, once
    )
    text = failure_text(outcomes, spec.expected, style)
    if text is not None:
        first, _, rest = text.partition("\n")
        ranks = f"{spec.world_size} rank{'s' if spec.world_size != 1 else ''}"
        seeded = settings_of(item.config).seed.report_line()
        message = f"{first}  [{ranks}, {item.nodeid}]\n{rest}\n{seeded}"
        raise _as_the_xfail_marker_expects(item, outcomes, spec, message)


_skipped_at_key = pytest.StashKey[tuple[str, int]]()


def place_skip(item: pytest.Item, report: pytest.TestReport) -> None:
    """A skip on every rank is reported where the ranks skipped (file and line), as pytest
    reports a plain test's, not at the test's own line."""
    at = item.stash.get(_skipped_at_key, None)
    if at is not None and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (at[0], at[1], report.longrepr[2])


def note_missed_faults(item: pytest.Item | None, outcomes: list[RankOutcome]) -> None:
    """Remember, for refuse_xfail, that a rank's fault never fired in `item`."""
    if item is not None and any(o.exc_type == FAULT_NOT_REACHED for o in outcomes):
        item.stash[_no_xfail_key] = True


def refuse_xfail(item: pytest.Item, report: pytest.TestReport) -> None:
    """Fail a test an xfail marker would have xfailed, where a rank's fault never fired."""
    if item.stash.get(_no_xfail_key, False) and hasattr(report, "wasxfail"):
        report.outcome = "failed"
        del report.wasxfail


def _xfail_if_ranks_did(outcomes: list[RankOutcome]) -> None:
    """Xfail when ranks xfailed and every other rank returned, or failed only for it (a peer
    waiting on an xfailed rank in a collective)."""
    xfailed = [o for o in outcomes if o.ending is Ending.XFAILED]
    others = [o for o in outcomes if o.ending not in (Ending.XFAILED, Ending.RETURNED)]
    if xfailed and all(o.looks_collateral for o in others):
        pytest.xfail(xfailed[0].message)


def _fail_a_partial_skip(outcomes: list[RankOutcome]) -> None:
    skipped = [o.rank for o in outcomes if o.ending is Ending.SKIPPED]
    ran = [o.rank for o in outcomes if o.ending is Ending.RETURNED]
    if skipped and len(skipped) + len(ran) == len(outcomes):
        reason = next(o.message for o in outcomes if o.ending is Ending.SKIPPED)
        pytest.fail(
            f"{ranks_phrase(skipped)} skipped ({reason}) while {ranks_phrase(ran)} ran: skip on "
            f"every rank or on none (decide from something every rank sees alike)",
            pytrace=False,
        )


def _as_the_xfail_marker_expects(
    item: pytest.Item, outcomes: list[RankOutcome], spec: RankSpec, message: str
) -> BaseException:
    """The failure to raise: pytest.fail's; or, for xfail(raises=E) where every rank's own
    failure (the root cause and those that failed on their own account, not the collateral
    ones) raised an E (or a subclass), an E, which is what pytest's xfail checks. A rank
    whose own failure is no E fails the test naming it, whichever rank failed first."""
    mark = item.get_closest_marker("xfail")
    raises = mark.kwargs.get("raises") if mark is not None else None
    if raises is None:
        return pytest.fail.Exception(message, pytrace=False)
    wanted = [c for c in (raises if isinstance(raises, tuple) else (raises,)) if _is_error(c)]
    own = _own_failures(outcomes, spec)
    unexpected = [o for o in own if _expected_class(wanted, o) is None]
    if unexpected or not own:
        shown = (
            getattr(raises, "__name__", None)
            or "(" + ", ".join(getattr(c, "__name__", repr(c)) for c in wanted) + ")"
        )
        said = "; ".join(f"rank {o.rank}'s failure: {o.describe()}" for o in unexpected)
        first = f"xfail(raises={shown}) does not expect {said}\n" if said else ""
        return pytest.fail.Exception(first + message, pytrace=False)
    cls = _expected_class(wanted, own[0])
    assert cls is not None
    with contextlib.suppress(Exception):
        error: BaseException = cls.__new__(cls)
        error.args = (message,)
        return error
    return pytest.fail.Exception(message, pytrace=False)


def _is_error(cls: object) -> TypeGuard[type[BaseException]]:
    return isinstance(cls, type) and issubclass(cls, BaseException)


def _own_failures(outcomes: list[RankOutcome], spec: RankSpec) -> list[RankOutcome]:
    """The ranks that failed on their own account: the root cause first, then the others
    no peer caused (the collateral ones left out)."""
    failed = failed_ranks(outcomes, spec.expected)
    found = diagnose(outcomes, failed)
    by_rank = {o.rank: o for o in outcomes}
    ranks = ([] if found.root is None else [found.root]) + list(found.independent)
    return [by_rank[r] for r in ranks]


def _expected_class(
    wanted: list[type[BaseException]], outcome: RankOutcome
) -> type[BaseException] | None:
    """The first of `wanted` the rank raised (an instance of it: a subclass counts)."""
    if outcome.ending is not Ending.RAISED:
        return None
    return next((cls for cls in wanted if _named(cls, outcome)), None)


def _named(cls: type, root: RankOutcome) -> bool:
    return expectations.class_name(cls) in root.exc_classes
