"""torchrun's error file in a failed launched session, tested directly with fakes for the
session's parts (no launch, no process): the first failed test and the rank its report
blames are remembered, rank 0 names the root cause for every rank, the blamed rank's entry is
its failure stamped first and every other rank's is collateral stamped after, and a rank
that cannot hear rank 0 tells its own story."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness.launched import error_files
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered

pytestmark = pytest.mark.unit


class FakeLink:
    def __init__(self, told: dict[str, Any] | None = None) -> None:
        self.values: dict[str, bytes] = {}
        self.gathered: list[str] = []
        if told is not None:
            self.values["root-cause"] = json.dumps(told).encode()
        self.peers = SimpleNamespace(lost="")

    def put(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str, seconds: float) -> bytes | None:
        return self.values.get(key)

    def gather(self, name: str, value: str, seconds: float, follow_exits: bool) -> Gathered:
        self.gathered.append(name)
        return Gathered([b"1", b"1"])


def _session(rank: int, link: FakeLink) -> Any:
    return SimpleNamespace(rank=rank, fate=Fate(), link=link, connected=True)


def _failed(text: str) -> Any:
    crash = SimpleNamespace(message="AssertionError: assert 1 == 2")
    return SimpleNamespace(
        failed=True, longreprtext=text, longrepr=SimpleNamespace(reprcrash=crash)
    )


def _entry(path: Path) -> tuple[str, str, int]:
    said = json.loads(path.read_text())["message"]
    extra = said["extraInfo"]
    return said["message"], extra["py_callstack"], int(extra["timestamp"])


@pytest.fixture
def error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    return path


def test_the_first_failure_is_kept_with_the_rank_its_report_blames() -> None:
    launched = _session(0, FakeLink())
    item = SimpleNamespace(nodeid="t.py::test_a")
    error_files.note(launched, item, _failed("rank 3 failed: ValueError: x\nmore"))
    error_files.note(launched, SimpleNamespace(nodeid="t.py::test_b"), _failed("E   boom"))
    first = launched.fate.first_failure
    assert (first.nodeid, first.root, first.line) == (
        "t.py::test_a",
        3,
        "rank 3 failed: ValueError: x",
    )


def test_a_failure_naming_no_rank_is_this_ranks_own() -> None:
    launched = _session(2, FakeLink())
    error_files.note(launched, SimpleNamespace(nodeid="t.py::test_a"), _failed("E   boom"))
    first = launched.fate.first_failure
    assert (first.root, first.line) == (2, "rank 2 failed: AssertionError: assert 1 == 2")


def test_rank_0_names_the_root_cause_and_writes_collateral_for_itself(error_file: Path) -> None:
    link = FakeLink()
    launched = _session(0, link)
    error_files.note(launched, SimpleNamespace(nodeid="t.py::test_a"), _failed("rank 1 failed: x"))
    error_files.write(launched, final=1)
    told = json.loads(link.values["root-cause"])
    assert (told["nodeid"], told["root"], told["line"]) == ("t.py::test_a", 1, "rank 1 failed: x")
    message, _, stamp = _entry(error_file)
    assert message == "collateral: t.py::test_a: rank 1 failed: x" and stamp == told["at"] + 1
    assert link.gathered == ["error-file"]  # every entry is written before any rank exits


def test_the_blamed_rank_writes_its_own_failure_stamped_first(error_file: Path) -> None:
    told = {"nodeid": "t.py::test_a", "root": 1, "line": "rank 1 failed: x", "at": 1000}
    launched = _session(1, FakeLink(told))
    error_files.note(launched, SimpleNamespace(nodeid="t.py::test_a"), _failed("rank 1 failed: x"))
    error_files.write(launched, final=1)
    message, callstack, stamp = _entry(error_file)
    assert message == "t.py::test_a: rank 1 failed: x" and stamp == 999
    assert callstack.startswith(message) and "rank 1 failed: x" in callstack.split("\n\n", 1)[1]


def test_without_rank_0s_word_a_rank_tells_its_own_story(error_file: Path) -> None:
    launched = _session(1, FakeLink())
    launched.fate.lose({0: "its node was lost"})
    error_files.note(launched, SimpleNamespace(nodeid="t.py::test_a"), _failed("rank 0 failed: y"))
    error_files.write(launched, final=1)
    assert _entry(error_file)[0] == "collateral: t.py::test_a: rank 0 failed: y"


def test_a_passing_session_writes_no_entry(error_file: Path) -> None:
    error_files.write(_session(0, FakeLink()), final=0)
    assert not error_file.exists()
