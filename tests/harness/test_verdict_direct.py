"""The verdict on a ranks test from every rank's outcome, tested directly with a fake item
(pytest's own objects and the ranks left out): what passes, skips, xfails and fails, and the
failure's first line naming the root cause."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness import seam
from harness.common import endings
from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import RankSpec
from harness.plan import settings
from harness.pytest_side import verdict
from tests.harness.conftest import outcome

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast

SPEC = RankSpec(world_size=2, timeout_s=60.0)


def _item(xfail: Any = None) -> Any:
    config = SimpleNamespace(stash=pytest.Stash(), getoption=lambda name, default=None: 0)
    seam.use(config, SimpleNamespace(reports_output=True))  # type: ignore[arg-type]
    seeded = SimpleNamespace(seed=SimpleNamespace(report_line=lambda: "ranks seeded from 7"))
    config.stash[settings._settings_key] = seeded
    return SimpleNamespace(
        config=config,
        nodeid="t.py::test_x",
        stash=pytest.Stash(),
        get_closest_marker=lambda name: xfail if name == "xfail" else None,
    )


def _raised(rank: int, error: BaseException) -> RankOutcome:
    return endings.raised("t0", rank, error)


def test_every_rank_returning_passes() -> None:
    verdict.judge(_item(), SPEC, [outcome(0, Ending.RETURNED), outcome(1, Ending.RETURNED)])


def test_a_skip_on_every_rank_skips_where_the_ranks_skipped() -> None:
    item = _item()
    skipped = [outcome(r, Ending.SKIPPED, message="no GPU", skipped_at=("t.py", 9)) for r in (0, 1)]
    with pytest.raises(pytest.skip.Exception, match="no GPU"):
        verdict.judge(item, SPEC, skipped)
    report = SimpleNamespace(skipped=True, longrepr=("t.py", 3, "Skipped: no GPU"))
    verdict.place_skip(item, report)  # type: ignore[arg-type]
    assert report.longrepr == ("t.py", 9, "Skipped: no GPU")


def test_a_skip_on_some_ranks_only_fails_naming_them() -> None:
    outcomes = [outcome(0, Ending.RETURNED), outcome(1, Ending.SKIPPED, message="odd")]
    with pytest.raises(pytest.fail.Exception, match=r"rank 1 skipped \(odd\) while rank 0 ran"):
        verdict.judge(_item(), SPEC, outcomes)


def test_an_xfail_on_a_rank_while_the_others_return_xfails() -> None:
    outcomes = [outcome(0, Ending.XFAILED, message="known"), outcome(1, Ending.RETURNED)]
    with pytest.raises(pytest.xfail.Exception, match="known"):
        verdict.judge(_item(), SPEC, outcomes)


def test_a_failure_names_its_root_cause_rank_test_and_seed() -> None:
    outcomes = [outcome(0, Ending.RETURNED), _raised(1, ValueError("bad batch"))]
    with pytest.raises(pytest.fail.Exception) as failed:
        verdict.judge(_item(), SPEC, outcomes)
    first = str(failed.value).splitlines()[0]
    assert first.startswith("rank 1 failed") and "[2 ranks, t.py::test_x]" in first
    assert "ranks seeded from 7" in str(failed.value)


def test_xfail_raises_gets_the_ranks_error_or_a_failure_naming_the_other() -> None:
    expected = SimpleNamespace(kwargs={"raises": ValueError})
    outcomes = [outcome(0, Ending.RETURNED), _raised(1, ValueError("bad batch"))]
    with pytest.raises(ValueError, match="rank 1 failed"):
        verdict.judge(_item(expected), SPEC, outcomes)
    other = [outcome(0, Ending.RETURNED), _raised(1, KeyError("k"))]
    with pytest.raises(pytest.fail.Exception, match=r"xfail\(raises=ValueError\) does not expect"):
        verdict.judge(_item(expected), SPEC, other)


def test_a_fault_that_never_fired_is_never_xfailed() -> None:
    item = _item()
    missed = outcome(1, Ending.RAISED, exc_type=verdict.FAULT_NOT_REACHED, message="never fired")
    verdict.note_missed_faults(item, [outcome(0, Ending.RETURNED), missed])
    report = SimpleNamespace(outcome="skipped", wasxfail="reason")
    verdict.refuse_xfail(item, report)  # type: ignore[arg-type]
    assert report.outcome == "failed" and not hasattr(report, "wasxfail")
