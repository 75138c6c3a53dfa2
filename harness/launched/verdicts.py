"""One verdict on every launched rank for what each rank runs on its own: a test without
ranks (every rank runs it in-process) and any test's teardown. A failure on any rank fails
it everywhere, naming that rank and showing its report; a rank that failed only because a
peer did (collateral) shows the peer's failure; a peer blocked in a collective on this rank
is released. Used only in a launched session.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Protocol

import pytest

from harness.common.diagnosis import report_looks_collateral
from harness.common.report_text import ranks_phrase
from harness.launched import records
from harness.launched.exchange import OutcomeExchange
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.link import Link
from harness.launched.nodes import Nodes
from harness.launched.position import Position
from harness.launched.session_group import SessionGroup
from harness.launched.voice import Voice
from harness.plan import timeout_interop
from harness.plan.settings import session_timeout, settings_of


class Judging(Protocol):
    """What the verdicts read of the launched session."""

    rank: int
    config: pytest.Config
    position: Position
    fate: Fate
    nodes: Nodes
    group: SessionGroup
    voice: Voice

    @property
    def connected(self) -> bool: ...

    @property
    def link(self) -> Link: ...

    @property
    def outcomes(self) -> OutcomeExchange: ...


def fixtures_key(launched: Judging) -> str:
    """Where a rank's record of a hang in the current test's fixtures goes."""
    return f"{launched.position.test_key()}/fixtures"


# How long a rank waits for the others to finish a test without ranks (each runs it on its
# own): a test that much slower on one rank than on another reads as ranks out of step.
PLAIN_WAIT_S = 600.0


def plain_verdict(launched: Judging, item: pytest.Item, report: pytest.TestReport) -> None:
    """One verdict for a test without ranks too: every rank ran it on its own; a failure on
    any rank fails it everywhere (naming the rank), so -x and the exit status agree."""
    if not launched.connected:
        return
    launched.link.finishing()
    mine = {
        "outcome": report.outcome,
        "text": report.longreprtext[-4000:],
        "xfail": getattr(report, "wasxfail", None),  # an xfail is reported as a skip
        "reason": _skip_reason(report),
        "sections": [(title, text[-4000:]) for title, text in report.sections],
    }
    # pytest-timeout off while this rank waits: a slow peer's own timer fails its own test,
    # and this rank then reports it (not a timeout in the harness's wait).
    with timeout_interop.pytest_timeout_paused(item):
        key = f"{launched.position.test_key()}/plain"
        found = _gather_releasing_peers(launched, key, report.failed, json.dumps(mine))
    if not found.complete:
        absent = found.absent_text()
        launched.fate.lose(found.absent)
        if 0 in launched.fate.lost:
            _speak_for_rank_0(launched)  # rank 0 cannot report this test: the lowest left does
        launched.fate.stop(f"ranks out of step at {item.nodeid} ({absent})", item.session)
        if report.outcome != "failed":  # a rank that never finished the test: no pass here
            report.outcome = "failed"
            report.longrepr = f"not every rank finished this test: {absent}"
    failed = [(r, t) for r, t in _others(launched, found, key) if t["outcome"] == "failed"]
    if report.outcome != "failed" and failed:
        rank, theirs = failed[0]
        report.outcome = "failed"
        here = f"it did not fail on rank {launched.rank}"
        report.longrepr = f"rank {rank} failed this test ({here}):\n{theirs['text']}"
        _add_sections(report, rank, theirs)
        _also_failed(report, failed, rank)
        return
    if report.outcome == "failed" and report_looks_collateral(report.longreprtext):
        causes = [(r, t) for r, t in failed if not report_looks_collateral(t["text"])]
        if causes:  # this rank failed because a peer did: report the peer's failure
            rank, theirs = causes[0]
            here = _error_line(report.longreprtext)
            report.longrepr = (
                f"rank {rank} failed this test (root cause); rank {launched.rank} collateral "
                f"({here}):\n{theirs['text']}"
            )
            _add_sections(report, rank, theirs)
            _also_failed(report, causes, rank)
        return
    if report.outcome == "failed":
        _also_failed(report, failed, launched.rank)
        return
    _agree_on_skips(report, _every_published(found, key))


def _speak_for_rank_0(launched: Judging) -> None:
    launched.voice.speak_for_rank_0(launched.fate, launched.nodes, launched.link.peers.lost)


def _also_failed(report: pytest.TestReport, failed: list[tuple[int, Any]], shown: int) -> None:
    """Every other rank's own failure, each in a section of the report: one rank's report
    would hide the others' errors (each rank runs a test without ranks on its own)."""
    for rank, theirs in failed:
        if rank != shown:
            report.sections.append((f"rank {rank} failed this test too", theirs["text"]))


# How often a rank whose test failed looks at the peers it still waits for: one blocked in
# torch.distributed (a collective on this rank, which will never come) makes it leave its
# process group, so the peer fails at once instead of at the group's timeout.
RELEASE_CHECK_S = 1.0


def _gather_releasing_peers(launched: Judging, key: str, failed: bool, mine: str) -> Gathered:
    """Every rank's `mine` under `key`; where this rank `failed`, a peer still blocked in
    torch.distributed (on this rank, most likely) is released by leaving the group."""
    if not failed:
        return launched.link.gather(key, mine, PLAIN_WAIT_S)
    start = time.monotonic()
    blocked_since: float | None = None
    found = launched.link.gather(key, mine, RELEASE_CHECK_S)
    while not found.complete and time.monotonic() - start < PLAIN_WAIT_S:
        waiting = [r for r in found.absent if launched.link.peers.still_in_this_test(r)]
        if not waiting:
            break
        blocked = [r for r in waiting if launched.link.peers.in_torch_distributed(r)]
        if blocked and launched.group.any_default():
            launched.group.drop()
            return launched.link.gather(key, None, PLAIN_WAIT_S - (time.monotonic() - start))
        # Blocked with no group here to leave (a set-up that failed before the rendezvous
        # the peer waits in): after the test's timeout it is hung, and the session ends.
        blocked_since = (blocked_since or time.monotonic()) if blocked else None
        if blocked_since is not None and time.monotonic() - blocked_since > _timeout(launched):
            why = "blocked in torch.distributed, waiting on this rank"
            return found.with_absent(dict.fromkeys(blocked, why))
        found = launched.link.gather(key, None, RELEASE_CHECK_S)
    return found


def _timeout(launched: Judging) -> float:
    return session_timeout(settings_of(launched.config))


# What each rank publishes of a test without ranks, and of a teardown.
_Fields = dict[str, type | tuple[type, ...]]
_PLAIN: _Fields = {
    "outcome": str, "text": str, "reason": str, "sections": list, "xfail": (str, type(None)),
}  # fmt: skip
_TEARDOWN: _Fields = {"failed": bool, "text": str, "group": bool}


def _others(launched: Judging, found: Gathered, key: str) -> list[tuple[int, Any]]:
    """The other ranks' published values, decoded, with their ranks."""
    every = _every_published(found, key)
    return [(r, said) for r, said in every.items() if r != launched.rank]


def _every_published(found: Gathered, key: str) -> dict[int, dict[str, Any]]:
    """Every published value, decoded, by rank: a value several ranks gave alike (a passing
    test's, nearly always) is read once, so a rank's work here stays the same at any world
    size. Read only: ranks that said the same share it."""
    read: dict[bytes, dict[str, Any]] = {}
    every = {}
    for r, blob in enumerate(found.values):
        if blob is None:
            continue
        said = read[blob] if blob in read else _published(blob, f"{key}/{r}")
        if not said.get("harness_error"):  # a refusal names its own rank's key
            read[blob] = said
        every[r] = said
    return every


def _published(blob: bytes, key: str) -> dict[str, Any]:
    """A rank's published verdict under `key`, checked; one that is not the harness's record
    reads as that rank's failure, naming the key (never believed, never run)."""
    fields = _TEARDOWN if key.rsplit("/", 2)[-2] == "teardown" else _PLAIN
    try:
        said = records.read_json(blob, key, fields)
        sections = said.get("sections", [])
        if not all(isinstance(x, list) and [type(y) for y in x] == [str, str] for x in sections):
            raise records.RecordError(f"the value under {key!r} has sections not of the harness")
        return said
    except records.RecordError as exc:
        text = f"harness error: {exc}; it was ignored"
        return {
            "outcome": "failed", "failed": True, "text": text, "reason": "", "sections": [],
            "xfail": None, "harness_error": True,
        }  # fmt: skip


def teardown_verdict(launched: Judging, item: pytest.Item, report: pytest.TestReport) -> None:
    """A teardown that failed on any rank is the test's error on every rank, naming the
    rank and showing its failure (rank 0 alone reports, and its own may have passed)."""
    if not launched.connected:
        return
    mine = {
        "failed": report.failed,
        "text": report.longreprtext[-4000:] if report.failed else "",
        "group": launched.group.is_default(),  # the next test's group, known where all hold it
    }
    lost_before = set(launched.fate.lost) | {launched.rank}
    # As for the verdict: a slow peer times itself.
    with timeout_interop.pytest_timeout_paused(item):
        key = f"{launched.position.test_key()}/teardown"
        found = _gather_releasing_peers(launched, key, report.failed, json.dumps(mine))
    gone = {r: why for r, why in found.absent.items() if r not in lost_before}
    if gone:  # a rank that died in its teardown (even with status 0), or hangs there
        absent = found.absent_text(set(gone))
        launched.fate.lose(gone)
        if 0 in launched.fate.lost:
            _speak_for_rank_0(launched)
        launched.fate.stop(
            f"ranks out of step at {item.nodeid}'s teardown ({absent})", item.session
        )
        if not report.failed:
            report.outcome = "failed"
            hung = launched.outcomes.hang_reports(fixtures_key(launched), sorted(gone))
            report.longrepr = f"not every rank finished this test's teardown: {absent}{hung}"
        return
    others = _others(launched, found, key)
    failed = [(r, t["text"]) for r, t in others if t["failed"]]
    if failed or report.failed:  # a fixture's collective may have broken the group
        launched.group.set_aside()  # the next test sets a fresh one up
    else:
        held = found.complete and all(t.get("group") is True for _, t in others)
        launched.group.held_everywhere(held and mine["group"] is True)
    if failed and not report.failed:
        rank, text = failed[0]
        report.outcome = "failed"
        report.longrepr = (
            f"rank {rank}'s teardown failed (it did not fail on rank {launched.rank}):\n{text}"
        )
    elif report.failed and report_looks_collateral(report.longreprtext):
        causes = [(r, text) for r, text in failed if not report_looks_collateral(text)]
        if causes:  # this rank's teardown failed because a peer's did: show the peer's
            rank, text = causes[0]
            here = _error_line(report.longreprtext)
            report.longrepr = (
                f"rank {rank}'s teardown failed (root cause); rank {launched.rank} "
                f"collateral ({here}):\n{text}"
            )


def _agree_on_skips(report: pytest.TestReport, outcomes: dict[int, dict[str, Any]]) -> None:
    """As for a ranks test: a skip on some ranks only fails the test on every rank (it ran
    on the others), and an xfail on some ranks while the others passed xfails it."""
    xfailed = sorted(r for r, o in outcomes.items() if o["xfail"] is not None)
    skipped = sorted(
        r for r, o in outcomes.items() if o["outcome"] == "skipped" and o["xfail"] is None
    )
    if skipped and len(skipped) < len(outcomes):
        ran = sorted(set(outcomes) - set(skipped))
        report.outcome = "failed"
        with contextlib.suppress(AttributeError):
            del report.wasxfail
        report.longrepr = (
            f"{ranks_phrase(skipped)} skipped this test ({outcomes[skipped[0]]['reason']}) "
            f"while {ranks_phrase(ran)} ran it: skip on every rank or on none (decide from "
            f"something every rank sees alike; to act on one rank, test the rank instead)"
        )
    elif xfailed and report.outcome == "passed":
        report.outcome = "skipped"
        report.wasxfail = outcomes[xfailed[0]]["xfail"]


def _add_sections(report: pytest.TestReport, rank: int, theirs: dict[str, Any]) -> None:
    """The failing rank's captured output and logs, beside this rank's own."""
    for title, text in theirs.get("sections", []):
        report.sections.append((f"{title} [rank {rank}]", text))


def _error_line(text: str) -> str:
    """The first "E   ..." line of a pytest failure report: the exception, in a line."""
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:300]
    return text.strip().splitlines()[-1][:300] if text.strip() else "failed"


def _skip_reason(report: pytest.TestReport) -> str:
    """A skipped report's reason, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    if report.outcome != "skipped" or not isinstance(longrepr, tuple):
        return ""
    return str(longrepr[2]).removeprefix("Skipped: ")
