"""A launched rank's watch, tested directly with a fake session (no launch, no process): a
hung rank publishes its hang and either leaves its last words and exits (a quiet rank) or
lets the main thread finish, else reports and exits (the rank that reports); the launcher's
SIGTERM after the end exits with the agreed status, and before it each node says what it saw."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness.common.launch_detect import Launch
from harness.common.outcome import Ending, RankOutcome
from harness.launched import watch as watch_module
from harness.launched.fate import Fate
from harness.launched.nodes import Nodes
from harness.launched.position import Position
from harness.launched.watch import Watch

pytestmark = pytest.mark.unit

TESTS = ["t.py::test_a", "t.py::test_b", "t.py::test_c"]


class Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class FakeVoice:
    def __init__(self, reports: bool) -> None:
        self.reporting = reports
        self.said: list[str] = []
        self.last: list[tuple[str, str]] = []
        self.told: list[tuple[str, str]] = []
        self.ended_early: list[str] = []

    def reports(self, fate: Fate, nodes: Nodes, peers: Any) -> bool:
        return self.reporting

    def say(self, text: str) -> None:
        self.said.append(text)

    def last_words(self, link: Any, nodes: Nodes, nodeid: str, text: str, hung_at: float) -> None:
        self.last.append((nodeid, text))

    def tell_node(self, nodes: Nodes, nodeid: str, text: str) -> None:
        self.told.append((nodeid, text))

    def end_early(self, link: Any, nodeid: str | None, text: str) -> None:
        self.ended_early.append(text)


class FakeOutcomes:
    """Every other rank returned from run `key`; this rank's own as its timer published it."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.hung: dict[str, RankOutcome] = {}

    def publish_hang(self, key: str, outcome: RankOutcome) -> None:
        self.hung[key] = outcome

    def own_outcome(self, key: str) -> RankOutcome:
        return self.hung[key]

    def exchange(self, key: str, outcome: RankOutcome, seconds: float) -> list[RankOutcome]:
        others = [RankOutcome(key, r, 100 + r, Ending.RETURNED) for r in range(self.world)]
        return [outcome if r == outcome.rank else others[r] for r in range(self.world)]


def _session(rank: int, reports: bool) -> Any:
    position = Position()
    position.collect(TESTS)
    position.begin(TESTS[0])
    launch = Launch(2, rank, rank, 1, "n1", 29500, True, "run/0")
    session = SimpleNamespace(
        rank=rank, fate=Fate(), position=position, nodes=Nodes(launch),
        voice=FakeVoice(reports), connected=True, link=SimpleNamespace(peers=None),
        outcomes=FakeOutcomes(2), stopped=0,
    )  # fmt: skip

    def launcher_stopped() -> bool:
        session.stopped += 1
        return bool(session.stopped == 1)

    session.launcher_stopped = launcher_stopped
    session.stop_report = lambda wait_s: "rank 1 was stopped - rank 0 died of SIGKILL"
    return session


@pytest.fixture(autouse=True)
def _no_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr("harness.launched.watch.os._exit", exit_)
    monkeypatch.setattr(watch_module, "FINISH_GRACE_S", 0.01)


def test_a_quiet_rank_that_hung_publishes_its_hang_leaves_its_last_words_and_exits() -> None:
    session = _session(rank=1, reports=False)
    with pytest.raises(Exited) as info:
        Watch(session).hung("t1", 5.0, "all_reduce('grads')")
    assert info.value.code == 1
    mine = session.outcomes.hung["t1"]
    assert mine.ending is Ending.HUNG and mine.rank == 1 and mine.where == "all_reduce('grads')"
    assert mine.notes == ("still running at the test's timeout (5 s)",)
    [(nodeid, text)] = session.voice.last
    assert nodeid == TESTS[0] and "rank 1" in text and "hung" in text


def test_the_reporting_rank_lets_the_main_thread_finish_when_it_can() -> None:
    session = _session(rank=0, reports=True)
    session.fate.over(1)  # the main thread reached the end within the grace
    Watch(session).hung("t1", 5.0, "")
    assert session.voice.said == [] and session.voice.last == []


def test_the_reporting_rank_reports_and_exits_when_the_main_thread_cannot_finish() -> None:
    session = _session(rank=0, reports=True)
    with pytest.raises(Exited) as info:
        Watch(session).hung("t1", 5.0, "")
    assert info.value.code == 1
    verdict, ended = session.voice.said
    assert verdict.startswith(f"FAILED {TESTS[0]} (reported by rank 0's timer)")
    assert "rank 0 hung" in ended and "there is no junit xml" in ended
    assert f"Tests not run (2):\n  {TESTS[1]}\n  {TESTS[2]}" in ended
    assert session.voice.ended_early == [verdict]


def test_sigterm_after_the_end_exits_with_the_agreed_status() -> None:
    session = _session(rank=1, reports=False)
    session.fate.over(3)
    with pytest.raises(Exited) as info:
        Watch(session)._stopped()
    assert info.value.code == 3 and session.stopped == 0


def test_sigterm_mid_test_on_a_quiet_rank_tells_its_node_what_it_saw_and_exits() -> None:
    session = _session(rank=1, reports=False)
    watch = Watch(session)
    with pytest.raises(Exited) as info:
        watch._stopped()
    assert info.value.code == 1
    assert session.voice.told == [(TESTS[0], "rank 0 died of SIGKILL")]
    watch._stopped()  # a second SIGTERM: noted already, nothing more
    assert session.stopped == 2 and len(session.voice.told) == 1
