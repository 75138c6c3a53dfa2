"""The launched session's link and outcome exchange, tested directly over a fake store (no
launch, no process): which keys a rank drops and when, a peer's early exit followed, every
rank's outcome read back, and a missing one read as what became of its rank."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from harness.common.launch_detect import Launch
from harness.common.outcome import Ending
from harness.launched import records
from harness.launched.exchange import OutcomeExchange
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.link import Link
from harness.launched.nodes import Nodes
from harness.launched.position import Position
from tests.harness.conftest import outcome

pytestmark = pytest.mark.unit


class FakePeers:
    """The launch's store as the link and the exchange use it: values by key, and each
    gather's answer given by the test (every rank's value, or some absent)."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self.values: dict[str, bytes] = {}
        self.dropped: list[str] = []
        self.absent: dict[int, str] = {}
        self.lost = ""
        self.lost_at = 0.0
        self.puts_with_gathers: list[list[str]] = []  # the keys set with each gather's value

    def put(self, key: str, value: bytes | str) -> None:
        self.values[key] = value.encode() if isinstance(value, str) else value

    def read(self, key: str) -> bytes | None:
        return self.values.get(key)

    def wait_for(self, key: str, seconds: float) -> bytes | None:
        return self.values.get(key)

    def drop(self, keys: list[str]) -> None:
        self.dropped += keys

    def gather(
        self, name: str, value: Any, seconds: float, lost: set[int], first: Any = ()
    ) -> Gathered:
        self.puts_with_gathers.append([key for key, _ in first])
        for key, said in first:
            self.put(key, said)
        if value is not None:  # as the store's gather: this rank's own value written first
            self.put(f"{name}/{self.rank}", value)
        found = [self.values.get(f"{name}/{r}") for r in range(self.world)]
        return Gathered([None if r in self.absent else v for r, v in enumerate(found)], self.absent)

    def last_sign_of_life(self, rank: int) -> float:
        return 7.0


def _parts(world: int = 4, rank: int = 0) -> tuple[FakePeers, Link, OutcomeExchange, Fate]:
    peers, position, fate = FakePeers(world, rank), Position(), Fate()
    position.collect([f"t.py::test_{i}" for i in range(3)])
    config: Any = SimpleNamespace()
    link = Link(peers, rank, position, fate, config)  # type: ignore[arg-type]
    launch = Launch(world, rank, rank % 2, 2, "127.0.0.1", 29500, True, "run/0", node=rank // 2)
    nodes = Nodes(launch)
    return peers, link, OutcomeExchange(link, rank, fate, nodes), fate


def test_a_tests_keys_are_dropped_once_every_rank_is_at_a_later_test() -> None:
    peers, link, _, _ = _parts(world=2)
    link._position.begin("t.py::test_0")  # type: ignore[attr-defined]
    link.put("t0/x", "1")
    link.put("pid/0", "5")  # not a test's key: kept for the session
    link._position.begin("t.py::test_1")  # type: ignore[attr-defined]
    peers.absent = {1: "late"}
    link.gather("t1/group", "1", 1.0)
    assert peers.dropped == []  # a rank may still read them
    peers.absent = {}
    peers.put("t1/group/1", "1")
    link.gather("t1/group", "1", 1.0)
    assert peers.dropped == ["t0/x"]


def test_a_gather_ends_this_session_as_a_peer_ended_its_own() -> None:
    peers, link, _, _ = _parts(world=2)
    peers.absent = {1: "ended its session"}
    peers.put("exit/1", json.dumps({"text": "Interrupted: stop", "code": 2}))
    with pytest.raises(pytest.exit.Exception, match=r"\[rank 1\] Interrupted: stop") as caught:
        link.gather("status", "0", 1.0)
    assert caught.value.returncode == 2
    assert link.gather("status", "0", 1.0, follow_exits=False).absent == {1: "ended its session"}


def test_every_ranks_outcome_comes_back_and_a_record_not_the_harnesss_is_named() -> None:
    peers, _, exchange, _ = _parts(world=3)
    for r in (1, 2):
        peers.put(f"t0/outcome/{r}", records.encode_outcome(outcome(r)))
    peers.values["t0/outcome/2"] = b'{"schema": "nope"}'
    got = exchange.exchange("t0", outcome(0), 1.0)
    assert [o.ending for o in got] == [Ending.RETURNED, Ending.RETURNED, Ending.RAISED]
    assert got[2].exc_type == "harness.RecordError" and "'t0/outcome/2'" in got[2].message


def test_a_rank_past_its_tests_body_says_so_with_its_outcome_not_on_its_own() -> None:
    """The test's own run: this rank's place (past the body) goes with its outcome, in the
    same store operation and first; a run_on_ranks call's exchange says nothing of it."""
    peers, link, exchange, _ = _parts(world=2)
    link._position.begin("t.py::test_1")  # type: ignore[attr-defined]
    peers.put("t1/outcome/1", records.encode_outcome(replace(outcome(1), key="t1")))
    exchange.exchange("t1", replace(outcome(0), key="t1"), 1.0, finishing=True)
    assert peers.puts_with_gathers == [["at/0"]]
    assert peers.values["at/0"] == b"3" and link._position.stage == 3  # type: ignore[attr-defined]
    peers.put("t1/c1/outcome/1", records.encode_outcome(replace(outcome(1), key="t1/c1")))
    exchange.exchange("t1/c1", replace(outcome(0), key="t1/c1"), 1.0)
    assert peers.puts_with_gathers[-1] == [] and peers.values["at/0"] == b"3"


def test_a_missing_outcome_is_what_its_rank_said_as_it_died_else_its_absence() -> None:
    peers, _, exchange, fate = _parts(world=4)
    peers.put("died/1", json.dumps({"text": "SIGSEGV in a fault", "signal": 11, "code": None}))
    peers.put("t0/outcome/3", records.encode_outcome(outcome(3)))
    peers.put("t0/outcome/2", records.encode_outcome(outcome(2)))
    peers.absent = {1: "gone", 2: "moved on"}  # rank 2's node holds rank 3: not lost whole
    got = exchange.exchange("t0", outcome(0), 1.0)
    assert (got[1].ending, got[1].signal) == (Ending.SIGNALLED, 11)
    assert got[1].notes == ("rank 1 gave no outcome: it died: SIGSEGV in a fault",)
    assert got[2].ending is Ending.HARD_EXIT and "moved on" in got[2].notes[0]
    assert fate.lost == {1: "it died: SIGSEGV in a fault", 2: "moved on"}


def test_a_node_whose_every_rank_is_silent_is_lost_as_a_whole() -> None:
    peers, _, exchange, fate = _parts(world=4)  # two nodes of two ranks, by the launcher
    peers.put("t0/outcome/1", records.encode_outcome(outcome(1)))
    peers.absent = {2: "silent", 3: "silent"}
    got = exchange.exchange("t0", outcome(0), 1.0)
    assert [got[r].ending for r in (2, 3)] == [Ending.LOST, Ending.LOST]
    assert got[2].message.startswith("node 1 was lost: none of its ranks gave an outcome")
    assert got[2].at == 7.0 and set(fate.lost) == {2, 3}


def test_a_hang_this_rank_published_is_its_own_outcome_and_is_not_sent_again() -> None:
    peers, _, exchange, _ = _parts(world=2)
    hung = outcome(0, Ending.HUNG, stack="s")
    exchange.publish_hang("t0", hung)
    assert exchange.own_outcome("t0") == hung
    peers.put("t0/outcome/1", records.encode_outcome(outcome(1)))
    assert exchange.exchange("t0", outcome(0), 1.0)[0] == hung
    assert "rank 0 failed: hung" in exchange.hang_reports("t0", [0])


@pytest.mark.parametrize(("said", "ending", "code", "signum"), [
    ({"signal": 9, "code": None}, Ending.SIGNALLED, None, 9),
    ({"signal": None, "code": 3}, Ending.HARD_EXIT, 3, None),
    ({"signal": None, "code": -1}, Ending.HARD_EXIT, -1, None),  # an exit status, not a signal
])  # fmt: skip
def test_a_rank_that_said_how_it_died_is_read_as_it_said(
    said: dict[str, Any], ending: Ending, code: int | None, signum: int | None
) -> None:
    peers, _, exchange, _ = _parts(world=2)
    peers.put("died/1", json.dumps({"text": "a fault", **said}))
    got = exchange.exchange("t0", outcome(0), 1.0)[1]
    assert (got.ending, got.exit_code, got.signal) == (ending, code, signum)


class CountingLink:
    """A link whose gathers are counted: every rank says it holds the group (no new one)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.gathers: list[str] = []

    def gather(self, name: str, value: str, seconds: float) -> Gathered:
        self.gathers.append(name)
        return Gathered([b"0"] * self.world)


def _group(held_here: bool) -> tuple[Any, CountingLink]:
    from harness.launched.session_group import SessionGroup

    launch = Launch(4, 2, 0, 2, "127.0.0.1", 29500, True, "run/0", node=1)
    group = SessionGroup(launch, "gloo")
    group.is_default = lambda: held_here  # type: ignore[method-assign]
    return group, CountingLink(4)


def test_a_tests_group_is_agreed_by_an_exchange_unless_every_rank_said_it_holds_it() -> None:
    group, link = _group(held_here=True)
    assert group.agree(link, "t0", 1.0, fresh=False, test_start=True).has_every_value  # type: ignore[arg-type]
    assert link.gathers == ["t0/group"]  # nothing known yet: exchanged
    group.held_everywhere(True)
    found = group.agree(link, "t1", 1.0, fresh=False, test_start=True)  # type: ignore[arg-type]
    assert found.values == [b"0"] * 4 and link.gathers == ["t0/group"]  # known: no exchange
    group.agree(link, "t2", 1.0, fresh=False, test_start=True)  # type: ignore[arg-type]
    assert link.gathers == ["t0/group", "t2/group"]  # known once, for the next test only


@pytest.mark.parametrize("why", ["a rank lacks it", "fresh asked", "a call in a test", "dropped"])
def test_the_group_is_exchanged_whenever_a_rank_may_not_hold_it(why: str) -> None:
    group, link = _group(held_here=True)
    group.held_everywhere(why != "a rank lacks it")
    if why == "dropped":
        group.drop()
    fresh, start = why == "fresh asked", why != "a call in a test"
    group.agree(link, "t1", 1.0, fresh=fresh, test_start=start)  # type: ignore[arg-type]
    assert link.gathers == ["t1/group"]


def test_a_rank_that_lost_the_group_after_every_rank_said_it_held_it_fails_naming_itself() -> None:
    from harness.common.errors import HarnessError

    group, link = _group(held_here=True)
    group.held_everywhere(True)
    group.is_default = lambda: False  # type: ignore[method-assign]
    with pytest.raises(HarnessError, match="rank 2 lost the session's process group"):
        group.agree(link, "t1", 1.0, fresh=False, test_start=True)  # type: ignore[arg-type]
    assert link.gathers == []
