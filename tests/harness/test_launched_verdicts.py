"""A launched session's one verdict on a teardown and on a test without ranks, tested directly
with fakes for the session's parts (no launch, no process): a peer's failure becomes every
rank's, a skip on some ranks only fails the test, and the ranks' word on the session's group
in the teardown's exchange spares the next test its own."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from harness.launched import verdicts
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.position import Position

pytestmark = pytest.mark.unit


class FakeGroup:
    def __init__(self, held: bool) -> None:
        self.held, self.aside = held, False
        self.everywhere: bool | None = None

    def is_default(self) -> bool:
        return self.held

    def any_default(self) -> bool:
        return self.held

    def held_everywhere(self, said: bool) -> None:
        self.everywhere = said

    def set_aside(self) -> None:
        self.aside = True


class FakeLink:
    """Every other rank's teardown record, as the test gives it; this rank's own as it says."""

    def __init__(self, theirs: dict[int, dict[str, Any]], world: int) -> None:
        self.theirs, self.world = theirs, world

    def gather(self, key: str, mine: str, seconds: float) -> Gathered:
        said = {0: mine.encode(), **{r: json.dumps(t).encode() for r, t in self.theirs.items()}}
        return Gathered([said.get(r) for r in range(self.world)])


def _teardown(
    theirs: dict[int, dict[str, Any]], failed_here: bool = False, held_here: bool = True
) -> tuple[Any, Any]:
    position = Position()
    position.collect(["t.py::test_0", "t.py::test_1"])
    position.begin("t.py::test_0")
    group = FakeGroup(held_here)
    launched: Any = SimpleNamespace(
        connected=True, rank=0, fate=Fate(), position=position, group=group,
        link=FakeLink(theirs, 1 + len(theirs)),
    )  # fmt: skip
    config = SimpleNamespace(pluginmanager=SimpleNamespace(hook=None, get_plugin=lambda _: None))
    item: Any = SimpleNamespace(nodeid="t.py::test_0", config=config, session=None)
    report: Any = SimpleNamespace(
        failed=failed_here, outcome="failed" if failed_here else "passed",
        longreprtext="E   RuntimeError: here" if failed_here else "", longrepr=None,
    )  # fmt: skip
    verdicts.teardown_verdict(launched, item, report)
    return report, group


def _ok(group: bool = True) -> dict[str, Any]:
    return {"failed": False, "text": "", "group": group}


def test_where_every_rank_holds_the_group_after_a_teardown_the_next_needs_no_exchange() -> None:
    report, group = _teardown({1: _ok(), 2: _ok(), 3: _ok()})
    assert report.outcome == "passed" and group.everywhere is True and not group.aside


@pytest.mark.parametrize("who", ["a peer", "this rank"])
def test_where_any_rank_lacks_the_group_the_next_test_agrees_on_it(who: str) -> None:
    theirs = {1: _ok(), 2: _ok(group=who != "a peer"), 3: _ok()}
    report, group = _teardown(theirs, held_here=who != "this rank")
    assert report.outcome == "passed" and group.everywhere is False


def test_a_peers_failed_teardown_is_this_ranks_error_and_the_group_is_set_aside() -> None:
    failed = {"failed": True, "text": "E   OSError: disk full", "group": True}
    report, group = _teardown({1: _ok(), 2: failed})
    assert report.outcome == "failed"
    assert report.longrepr.startswith("rank 2's teardown failed (it did not fail on rank 0)")
    assert "OSError: disk full" in report.longrepr
    assert group.aside and group.everywhere is None  # a fresh group next: no word kept


def test_a_record_not_the_harnesss_reads_as_that_ranks_failure() -> None:
    report, group = _teardown({1: {"failed": "no", "text": 3}})
    assert report.outcome == "failed" and "rank 1's teardown failed" in report.longrepr
    assert "harness error" in report.longrepr and group.aside


def _plain(outcome: str, xfail: str | None = None) -> dict[str, Any]:
    return {"outcome": outcome, "xfail": xfail, "reason": "no GPU", "text": "", "sections": []}


def test_a_skip_on_some_ranks_only_fails_the_test_and_an_xfail_beside_passes_xfails_it() -> None:
    report: Any = SimpleNamespace(outcome="passed", longrepr=None)
    verdicts._agree_on_skips(report, {0: _plain("passed"), 1: _plain("skipped")})
    assert report.outcome == "failed"
    assert report.longrepr.startswith("rank 1 skipped this test (no GPU) while rank 0 ran it")
    report = SimpleNamespace(outcome="passed", longrepr=None)
    verdicts._agree_on_skips(report, {0: _plain("passed"), 1: _plain("skipped", "flaky")})
    assert report.outcome == "skipped" and report.wasxfail == "flaky"


def test_a_record_many_ranks_gave_alike_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's work on the exchange stays the same at any world size."""
    read = []
    real = verdicts.records.read_json

    def counted(*args: Any, **kwargs: Any) -> Any:
        read.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(verdicts.records, "read_json", counted)
    report, group = _teardown({r: _ok() for r in range(1, 16)})
    assert report.outcome == "passed" and group.everywhere is True
    assert len(read) == 1  # fifteen ranks said the same: read once
    failed = {"failed": True, "text": "E   OSError: disk full", "group": True}
    report, _ = _teardown({1: _ok(), 2: failed, 3: failed})
    assert report.longrepr.startswith("rank 2's teardown failed")


def test_records_refused_alike_each_name_their_own_key() -> None:
    bad = json.dumps({"failed": "no", "text": 3}).encode()
    every = verdicts._every_published(Gathered([None, bad, bad]), "t0/teardown")
    assert set(every) == {1, 2}
    for rank in (1, 2):
        assert every[rank]["failed"] is True
        assert f"'t0/teardown/{rank}'" in every[rank]["text"], every[rank]["text"]
