"""The launched session's pure parts tested directly, without processes or a store: where a
rank is (Position), what becomes of the session (Fate), which node each rank runs on (Nodes),
what an exchange found (Gathered) and which rank a report blames (blame)."""

from __future__ import annotations

import pytest

from harness.common.launch_detect import Launch
from harness.launched.blame import blamed_rank, headline
from harness.launched.fate import Fate, FirstFailure
from harness.launched.gathered import Gathered
from harness.launched.nodes import Nodes
from harness.launched.position import Position

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast

TESTS = ["t.py::a", "t.py::b", "t.py::c"]


def _position() -> Position:
    position = Position()
    position.collect(TESTS)
    return position


def test_a_tests_stages_are_its_place_twice_and_once_more_when_finishing() -> None:
    position = _position()
    assert position.begin("t.py::b") == 2 and position.finishing() == 3
    assert position.test_key() == "t1" and position.current == "t.py::b"
    assert position.name_of(2) == "t.py::b" and position.name_of(3) == "the end of t.py::b"
    assert position.name_of(-1) == "no test yet"
    assert position.name_of(6) == "the end of the session"


def test_runs_and_own_groups_are_numbered_afresh_in_each_test() -> None:
    position = _position()
    position.begin("t.py::a")
    assert [position.call_key(), position.call_key()] == ["t0/c1", "t0/c2"]
    assert position.own_group_key() == "own_groups/t0/1"
    position.begin("t.py::c")
    assert position.call_key() == "t2/c1" and position.own_group_key() == "own_groups/t2/1"


def test_tests_not_begun_are_the_ones_not_run_and_the_end_is_past_them_all() -> None:
    position = _position()
    position.begin("t.py::a")
    assert position.not_run() == ["t.py::b", "t.py::c"]
    assert position.past_every_test() == 6
    assert position.name_of(position.past_every_test()) == "the end of the session"
    position.at_the_end()
    assert position.test_key() == "t3"


def test_a_test_outside_the_agreed_list_keeps_the_last_place() -> None:
    position = _position()
    position.begin("t.py::b")
    assert position.begin("elsewhere.py::x") == 2  # keys stay those of the last known place


def test_the_lost_ranks_are_grouped_by_reason_and_a_known_reason_stays() -> None:
    fate = Fate()
    fate.lose({3: "its node went down", 2: "its node went down"})
    fate.lose_unless_known(2, "late")
    fate.lose_unless_known(5, "late")
    assert fate.lost_reasons() == ["ranks 2, 3: its node went down", "rank 5: late"]
    fate.lose({5: "it died"})  # the latest word on a rank replaces the earlier one
    assert fate.lost[5] == "it died"


def test_the_first_failure_is_kept_and_the_agreed_status_ends_the_session() -> None:
    fate = Fate()
    first = FirstFailure("t.py::a", 1, "rank 1 failed", "text")
    fate.note_failure(first)
    fate.note_failure(FirstFailure("t.py::b", 0, "rank 0 failed", "text"))
    assert fate.first_failure == first
    assert not fate.finished.is_set()
    fate.over(1)
    assert fate.final_status == 1 and fate.finished.is_set()


def _launch(world: int, per_node: int, node: int | None = 0) -> Launch:
    return Launch(world, 0, 0, per_node, "127.0.0.1", 29500, True, "run/0", node=node)


def test_a_ranks_node_is_what_it_said_else_the_launchers_numbering() -> None:
    nodes = Nodes(_launch(4, 2), said={0: "node 0 (host n1)", 1: "node 0 (host n1)"})
    assert nodes.node_of(0) == "node 0 (host n1)"
    assert nodes.node_of(3) == "node 1"  # never said: LOCAL_WORLD_SIZE consecutive ranks
    assert nodes.ranks_on("node 1") == [2, 3]
    assert nodes.named([0, 1, 3]) == "node 0 (host n1), node unknown"


def test_where_the_launcher_numbers_no_nodes_a_silent_ranks_node_is_unknown() -> None:
    assert Nodes(_launch(4, 2, node=None)).node_of(3) == ""
    assert Nodes(_launch(5, 2)).node_of(3) == ""  # ranks do not split evenly into nodes


def test_the_store_node_s_lowest_rank_and_each_node_s_leader() -> None:
    said = {r: f"node {r // 2}" for r in range(4)}
    nodes = Nodes(_launch(4, 2), said=said, store_node="node 1")
    assert nodes.store_rank() == 2
    assert [nodes.leads_node(r) for r in range(4)] == [True, False, True, False]
    assert Nodes(_launch(4, 2), said=said).store_rank() is None


def test_what_a_gather_found_and_why_each_rank_is_absent() -> None:
    found = Gathered([b"a", None, b"c", None], {3: "late", 1: "it died"})
    assert not found.complete and not found.has_every_value
    assert found.why(1) == "it died" and found.why(0) == "gone"
    assert found.absent_text() == "rank 1: it died; rank 3: late"
    assert found.absent_text({3}) == "rank 3: late"
    more = found.with_absent({3: "its node went down"})
    assert more.absent == {1: "it died", 3: "its node went down"}
    assert found.absent[3] == "late"  # a result: the original is unchanged


def test_with_the_store_lost_every_value_is_missing_yet_no_peer_is_counted_absent() -> None:
    found = Gathered([None, None], {})
    assert found.complete and not found.has_every_value


@pytest.mark.parametrize(
    ("line", "rank"),
    [
        ("rank 1 failed: ValueError: bad", 1),
        ("rank 2's teardown failed (RuntimeError)", 2),
        ("rank 3 waited in all_reduce while ranks 0, 1, 2 returned", 3),
        ("node 1 (host n2) was lost: its link went down (ranks 2, 3); rank 0 waited", 2),
        ("node 3 (host n4) was lost: killed (rank 7)", 7),
        ("not every rank finished setting up", None),
        ("ranked 4th", None),
    ],
)
def test_the_rank_a_reports_headline_blames(line: str, rank: int | None) -> None:
    assert blamed_rank(line) == rank


def test_a_reports_headline_is_its_first_line_that_says_something() -> None:
    assert headline("\n   \nrank 1 failed: x\nmore") == "rank 1 failed: x"
    assert headline("") == ""
