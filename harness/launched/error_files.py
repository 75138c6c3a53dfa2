"""torchrun's summary names the rank the harness names.

When a launched session fails, torchrun prints its own summary after ours, and its "Root
Cause" is the worker whose error file (TORCHELASTIC_ERROR_FILE) has the smallest timestamp,
else the one it saw exit first: often not the rank our report blames. So at the session's
end rank 0 publishes the first failed test's root cause (the rank its report names first),
every rank writes its entry (the root cause its own failure, stamped a second before the
agreed time; every other rank "collateral: ..." a second after), and no rank exits before
every rank has written: the launcher reads the files of ranks it stops as well.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

import pytest
from rankwise.testing import write_launcher_error

from harness.launched import records
from harness.launched.blame import blamed_rank
from harness.launched.fate import Fate, FirstFailure
from harness.launched.link import Link
from harness.launched.session import AGREE_S


class Filing(Protocol):
    """What the error files read of the launched session."""

    rank: int
    fate: Fate

    @property
    def connected(self) -> bool: ...

    @property
    def link(self) -> Link: ...


def note(launched: Filing, item: pytest.Item, report: pytest.TestReport) -> None:
    """Remember the session's first failed test (every rank reports every test alike)."""
    if report.failed and launched.fate.first_failure is None:
        root, line = _blamed(report, launched.rank)
        launched.fate.note_failure(FirstFailure(item.nodeid, root, line, report.longreprtext))


def _blamed(report: pytest.TestReport, this_rank: int) -> tuple[int, str]:
    """The rank a failure report names first and its line; this rank for its own failure."""
    first = report.longreprtext.strip().splitlines()[0] if report.longreprtext.strip() else ""
    found = blamed_rank(first)
    if found is not None:
        return found, first
    crash = getattr(report.longrepr, "reprcrash", None)
    said = getattr(crash, "message", "") or first or "failed"
    return this_rank, f"rank {this_rank} failed: {said.splitlines()[0]}"


def write(launched: Filing, final: int) -> None:
    """At the session's agreed end: every rank's entry for torchrun, the root cause first.

    Only in a failed session under torchrun (TORCHELASTIC_ERROR_FILE set); rank 0 decides
    which test and rank, so every rank writes the same story.
    """
    if final == 0 or not launched.connected:
        return
    told = _agree_on_root(launched)
    if told is None:
        return
    nodeid, root, line, stamp = told["nodeid"], told["root"], told["line"], told["at"]
    if launched.rank == root:
        own = launched.fate.first_failure
        said = f"{nodeid}: {line}"  # torchrun shows the callstack: it starts with the headline
        text = f"{said}\n\n{own.text}" if own is not None and own.nodeid == nodeid else said
        wrote = write_launcher_error(said, text, stamp - 1)
    else:
        said = f"collateral: {nodeid}: {line}"
        wrote = write_launcher_error(said, said, stamp + 1)
    if wrote:  # the launcher stops the job at the first exit: every entry is there by then
        launched.link.gather("error-file", "1", AGREE_S, follow_exits=False)


def _agree_on_root(launched: Filing) -> dict[str, Any] | None:
    """Rank 0's word on the session's root cause, or None (no failed test to name)."""
    if launched.rank == 0:
        first = launched.fate.first_failure
        told = (
            None
            if first is None
            else {"nodeid": first.nodeid, "root": first.root, "line": first.line[:2000]}
        )
        if told is not None:
            told["at"] = int(time.time())
        launched.link.put("root-cause", json.dumps(told))
        return told
    if 0 in launched.fate.lost or launched.link.peers.lost:  # no word of rank 0's: this rank's own
        first = launched.fate.first_failure
        if first is None:
            return None
        return {"nodeid": first.nodeid, "root": first.root, "line": first.line[:2000],
                "at": int(time.time())}  # fmt: skip
    blob = launched.link.get("root-cause", AGREE_S)
    if blob is None:
        return None
    try:
        told = records.read_json(
            blob, "root-cause", {"nodeid": str, "root": int, "line": str, "at": int}
        )
    except records.RecordError:
        return None  # rank 0 named none (null), or the record is not rank 0's word
    return told
