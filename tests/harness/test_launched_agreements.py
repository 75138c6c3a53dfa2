"""What the launched ranks agree on, tested directly with fakes for the session's parts (no
launch, no process): the tests each rank collected, one exit status, and the backend and
versions, each disagreement ending the session on every rank alike, naming ranks and nodes."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from harness.common.launch_detect import Launch
from harness.launched import agreements
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.nodes import Nodes
from harness.launched.position import Position

pytestmark = pytest.mark.unit

TESTS = ["t.py::test_a", "t.py::test_b"]


class FakeLink:
    """Each rank's word under every key as the test gives it (None: that rank said nothing);
    this rank's own as it says it. What this rank puts is kept in `put`."""

    def __init__(self, rank: int, theirs: dict[int, Any], world: int) -> None:
        self.rank, self.theirs, self.world = rank, theirs, world
        self.put_values: dict[str, str] = {}
        self.gets: dict[str, bytes | None] = {}
        self.peers = SimpleNamespace(lost="")

    def gather(self, key: str, mine: str, seconds: float, follow_exits: bool = True) -> Gathered:
        said = {r: None if t is None else _blob(t) for r, t in self.theirs.items()}
        said[self.rank] = mine.encode()
        values = [said.get(r) for r in range(self.world)]
        return Gathered(values, {r: "no sign of life" for r, v in enumerate(values) if v is None})

    def put(self, key: str, value: str) -> None:
        self.put_values[key] = value

    def get(self, key: str, seconds: float) -> bytes | None:
        return self.gets.get(key)


def _blob(word: Any) -> bytes:
    return word if isinstance(word, bytes) else json.dumps(word).encode()


def _launched(theirs: dict[int, Any], rank: int = 0, world: int = 4) -> Any:
    launch = Launch(world, rank, rank % 2, 2, "n1", 29500, True, "run/0", node=rank // 2)
    said = {r: f"node {r // 2} (host n{r // 2 + 1})" for r in range(world)}
    config = SimpleNamespace(
        pluginmanager=SimpleNamespace(get_plugin=lambda _: None, getplugin=lambda _: None),
        getoption=lambda name, default=None: default,
    )
    fate = Fate()
    return SimpleNamespace(
        rank=rank, config=config, launch=launch, position=Position(), fate=fate,
        nodes=Nodes(launch, said, said[0]), link=FakeLink(rank, theirs, world),
        over=fate.over,
    )  # fmt: skip


def _collected(tests: list[str], errors: list[str] | None = None) -> dict[str, Any]:
    return {"tests": tests, "errors": errors or []}


def _items(nodeids: list[str]) -> list[Any]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_ranks_that_collected_alike_go_on() -> None:
    launched = _launched({r: _collected(TESTS) for r in (1, 2, 3)})
    agreements.agree_on_collection(launched, _items(TESTS))
    assert launched.fate.final_status is None and launched.position.name_of(0)


def test_ranks_that_collected_other_tests_end_the_session_named_with_their_node() -> None:
    theirs = {
        1: _collected(TESTS),
        2: _collected([*TESTS, "t.py::test_c"]),
        3: _collected(TESTS[::-1]),
    }
    launched = _launched(theirs)
    with pytest.raises(pytest.exit.Exception) as info:
        agreements.agree_on_collection(launched, _items(TESTS))
    said = str(info.value)
    assert "rank 2 (node 1 (host n2)) collected 1 test(s) rank 0 did not (t.py::test_c)" in said
    assert "rank 3 (node 1 (host n2)) collected the same tests in another order" in said
    assert "rank 1" not in said and "select the same tests everywhere" in said
    assert launched.fate.final_status == int(pytest.ExitCode.INTERRUPTED)


def test_a_peers_collection_error_stops_every_rank_and_is_kept_for_this_ranks_report() -> None:
    theirs = {1: _collected(TESTS, ["t.py:\nE   ImportError: no module named cuda_ext"])}
    launched = _launched({**theirs, 2: _collected(TESTS), 3: _collected(TESTS)})
    with pytest.raises(pytest.exit.Exception, match=r"1 collection error\(s\)") as info:
        agreements.agree_on_collection(launched, _items(TESTS))
    assert "rank 1 could not collect t.py:\nE   ImportError" in str(info.value)
    assert launched.fate.peer_collection_errors == [
        "rank 1 could not collect t.py:\nE   ImportError: no module named cuda_ext"
    ]


@pytest.mark.parametrize(
    "word, said",
    [(None, "rank 3 did not finish collecting: no sign of life"),
     (b"not json", "rank 3's collection could not be read")],
    ids=["silent", "unreadable"],
)  # fmt: skip
def test_a_rank_that_did_not_finish_collecting_is_named(word: Any, said: str) -> None:
    launched = _launched({1: _collected(TESTS), 2: _collected(TESTS), 3: word})
    with pytest.raises(pytest.exit.Exception, match="before any test ran") as info:
        agreements.agree_on_collection(launched, _items(TESTS))
    assert said in str(info.value)


def _exit(theirs: dict[int, Any], status: int, rank: int = 0) -> Any:
    launched = _launched(theirs, rank=rank)
    session: Any = SimpleNamespace(exitstatus=status, config=launched.config)
    launched.position.collect(TESTS)
    agreements.agree_on_exit(launched, session)
    return launched, session


@pytest.mark.parametrize(
    "mine, theirs, final",
    [(0, {1: 0, 2: 0, 3: 0}, 0), (0, {1: 0, 2: 1, 3: 2}, 1), (2, {1: 1, 2: 0, 3: 0}, 2),
     (0, {1: 0, 2: None, 3: 0}, 1), (0, {1: 0, 2: "garbled", 3: 0}, 1)],
    ids=["all passed", "a peer's failure", "rank 0's own first", "a silent peer", "a garbled word"],
)  # fmt: skip
def test_rank_0_decides_one_exit_status_and_publishes_it(
    mine: int, theirs: dict[int, Any], final: int, capfd: pytest.CaptureFixture[str]
) -> None:
    words = {
        r: None if s is None else (b"{" if s == "garbled" else {"status": s, "failed": []})
        for r, s in theirs.items()
    }
    launched, session = _exit(words, mine)
    assert session.exitstatus == final and launched.fate.final_status == final
    assert launched.link.put_values == {"final": str(final)}
    said = capfd.readouterr().err  # a word not the harness's is said, past the capture
    assert ("status/2" in said and "counted as a failed session" in said) == (
        "garbled" in theirs.values()
    )


def test_a_lost_rank_fails_the_session_even_where_every_word_said_passed() -> None:
    launched = _launched({r: {"status": 0, "failed": []} for r in (1, 2, 3)})
    launched.fate.lose({3: "its node was lost"})
    session: Any = SimpleNamespace(exitstatus=0, config=launched.config)
    agreements.agree_on_exit(launched, session)
    assert session.exitstatus == int(pytest.ExitCode.TESTS_FAILED)


@pytest.mark.parametrize("rank_0", ["published 3", "published nothing", "was lost"])
def test_another_rank_takes_rank_0s_status_or_says_why_not(
    rank_0: str, capfd: pytest.CaptureFixture[str]
) -> None:
    launched = _launched({0: {"status": 0, "failed": []}}, rank=2)
    if rank_0 == "published 3":
        launched.link.gets["final"] = b"3"
    elif rank_0 == "was lost":
        launched.fate.lose({0: "its node was lost"})
    session: Any = SimpleNamespace(exitstatus=0, config=launched.config)
    agreements.agree_on_exit(launched, session)
    expected = {"published 3": 3, "published nothing": 0, "was lost": 1}[rank_0]
    assert session.exitstatus == expected == launched.fate.final_status
    assert launched.link.put_values == {}  # only rank 0 publishes
    said = capfd.readouterr().err
    assert ("rank 2 could not learn rank 0's exit status" in said) == (
        rank_0 == "published nothing"
    )


def test_ranks_with_different_torch_end_the_session_naming_each_version_and_node() -> None:
    words = [{"torch": "2.13.0"}, {"torch": "2.13.0"}, {"torch": "2.6.0"}, {"torch": "2.6.0"}]
    launched = _launched({})
    with pytest.raises(pytest.exit.Exception) as info:
        agreements._agree_on(launched, words, "torch", "install the same torch on every node")
    assert str(info.value) == (
        "harness: the launched ranks differ: torch 2.13.0 on ranks 0, 1 (node 0 (host n1)); "
        "torch 2.6.0 on ranks 2, 3 (node 1 (host n2)); install the same torch on every node"
    )
    agreements._agree_on(launched, words[:2], "torch", "")  # alike: nothing happens


def test_a_word_not_the_harnesss_is_ignored_and_said_loud() -> None:
    launched = _launched({})
    assert agreements._word(launched, 1, None) == {}
    word = {"backend": "gloo", "seed": 1, "source": "a stranger", "nonce": "n", "torch": "t",
            "rankwise": "r", "node": "n", "store": False}  # fmt: skip
    assert agreements._word(launched, 1, json.dumps(word).encode()) == {}
    word["source"] = "drawn"
    assert agreements._word(launched, 1, json.dumps(word).encode()) == word


def test_ranks_absent_from_the_start_are_named_by_node_where_their_reason_is_alike() -> None:
    launched = _launched({})
    found = Gathered(
        [b"", b"", None, None],
        {2: "no sign of life for 15.0 s", 3: "no sign of life for 16.2 s"},
    )
    assert agreements._absent_by_node(launched, found) == (
        "node 1 (host n2) (ranks 2, 3): no sign of life for some seconds"
    )
