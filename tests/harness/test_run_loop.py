"""The run loop's decisions, without processes: fake rank slots (real pipes, no processes)
answer as ranks would, as xdist tests its scheduler with mock nodes.

Each test plays the ranks' side of one run: results, deaths, silence, operations boards,
and checks what the loop decided (each rank's ending and note, whether the pool must close,
which ranks it asked for stacks, what it told a rank).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import Kind, Message, RankFiles, RankSpec, RunTask, Settled, Target
from harness.common.rank_state import RankResult, RankState
from harness.seam import Cut
from harness.warm.collective_match import MISMATCH_TYPE
from harness.warm.live_output import LiveStreams, RunOutput
from harness.warm.run_loop import TEST_FAILURE_GRACE, RunEnd, RunLoop

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast

KEY = "this-run"


class FakeProcess:
    """A rank's process as the loop sees it: a sentinel that becomes readable when it dies."""

    def __init__(self) -> None:
        self.sentinel, self._alive_end = os.pipe()
        self.exitcode: int | None = None

    def die(self, exitcode: int) -> None:
        self.exitcode = exitcode
        os.close(self._alive_end)

    def join(self, timeout: float | None = None) -> None:
        pass


class FakeSlot:
    """One rank: the loop's end of a pipe, the rank's end (`rank_end`), files, a board."""

    def __init__(self, rank: int, directory: Path) -> None:
        self.rank, self.pid = rank, 1000 + rank
        self.conn, self.rank_end = multiprocessing.Pipe()
        self.process = FakeProcess()
        self.files = RankFiles.in_dir(directory, rank)
        self.issued = 0  # operations issued on the group in this test
        self.collectives: list[str] = []  # their fingerprints, in order
        self.where = ""  # the labelled collective it is in

    def empty_output(self) -> None:
        for path in (self.files.stdout, self.files.stderr):
            path.write_bytes(b"")

    def clear_board(self) -> None:
        pass

    def read_issued(self) -> int:
        return self.issued

    def collectives_called(self) -> int:
        return len(self.collectives)

    def read_collectives(self) -> tuple[int, dict[int, str]]:
        return len(self.collectives), dict(enumerate(self.collectives))

    def read_where(self) -> str:
        return self.where

    def answer(self, ending: Ending, key: str = KEY, **fields: Any) -> None:
        """Send this rank's result, as a worker does (`kept_group`: the group it kept)."""
        state = RankState(kept_group=fields.pop("kept_group", None))
        outcome = RankOutcome(key, self.rank, self.pid, ending, **fields)
        self.rank_end.send(Message(Kind.RESULT, RankResult(outcome, state)))

    def settle(self, leaving: bool = False, key: str = KEY) -> None:
        self.rank_end.send(Message(Kind.SETTLED, Settled(key, leaving)))


@pytest.fixture
def slots(tmp_path: Path) -> Any:
    def make(size: int) -> list[FakeSlot]:
        return [FakeSlot(rank, tmp_path) for rank in range(size)]

    return make


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_FAILURE_GRACE, "0.2")


class Dumps:
    """Stands for the stacks dump: records which ranks the loop asked for."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def __call__(self, ranks: dict[int, tuple[int, Path]]) -> dict[int, str]:
        self.asked.append(sorted(ranks))
        return {rank: f"stack of rank {rank}" for rank in ranks}


def _run(
    slots: list[FakeSlot],
    timeout_s: float = 10.0,
    live: LiveStreams | None = None,
    cut: Cut | None = None,
    dumps: Dumps | None = None,
    key: str = KEY,
) -> RunEnd:
    spec = RankSpec(len(slots), timeout_s)
    target = Target("tests.harness.test_run_loop", None, "_run")
    tasks = [RunTask(key, s.rank, spec, target, b"", "store", "p/") for s in slots]
    output = RunOutput([(s.rank, s.files) for s in slots], live)
    return RunLoop(slots, tasks, output, cut, dumps or Dumps()).collect()


def test_a_late_result_of_an_earlier_run_is_never_credited(slots: Any) -> None:
    ranks = slots(2)
    for slot in ranks:  # each rank first answers an old run, then this one
        slot.answer(Ending.RAISED, key="old-run")
        slot.answer(Ending.RETURNED)
    end = _run(ranks)
    assert [(o.key, o.ending) for o in end.outcomes] == [(KEY, Ending.RETURNED)] * 2
    assert not end.must_close


def test_only_late_results_mean_a_hang(slots: Any) -> None:
    ranks = slots(1)
    ranks[0].answer(Ending.RETURNED, key="old-run")
    dumps = Dumps()
    end = _run(ranks, timeout_s=0.3, dumps=dumps)
    assert end.outcomes[0].ending is Ending.HUNG and end.outcomes[0].key == KEY
    assert dumps.asked == [[0]] and end.must_close


def test_a_hang_dumps_every_stuck_ranks_stack_and_closes_the_pool(slots: Any) -> None:
    ranks = slots(3)
    ranks[1].answer(Ending.RETURNED)  # rank 1 is done; 0 and 2 never answer
    dumps = Dumps()
    end = _run(ranks, timeout_s=0.3, dumps=dumps)
    assert [o.ending for o in end.outcomes] == [Ending.HUNG, Ending.RETURNED, Ending.HUNG]
    assert dumps.asked == [[0, 2]]
    assert end.outcomes[2].stack == "stack of rank 2"
    assert end.outcomes[0].notes == ("still running at the 0.3 s timeout; killed",)
    assert not end.outcomes[0].after_failure
    assert end.must_close


def test_a_peer_waiting_on_the_failed_rank_gets_the_grace_not_the_timeout(slots: Any) -> None:
    for sign in ("labelled collective", "operation issued past it"):
        ranks = slots(2)
        if sign == "labelled collective":
            ranks[0].where = "all_reduce('batch')"
        else:
            ranks[0].issued, ranks[1].issued = 3, 2
        ranks[1].answer(Ending.RAISED, exc_type="builtins.ValueError", message="bad")
        dumps = Dumps()
        end = _run(ranks, timeout_s=30.0, dumps=dumps)  # returns after the 0.2 s grace
        root, peer = end.outcomes[1], end.outcomes[0]
        assert root.ending is Ending.RAISED
        assert peer.ending is Ending.HUNG and peer.after_failure, sign
        assert peer.notes[0].startswith("still running ") and "after a peer failed" in peer.notes[0]
        assert dumps.asked == [[0]]
        assert end.must_close


def test_a_peer_not_waiting_on_the_failed_rank_ends_on_its_own_after_the_grace(
    slots: Any,
) -> None:
    """No time decides a verdict: a peer with no sign of waiting on the failed rank (outside
    any collective, nothing issued past it) is waited for beyond the grace, and its own
    ending counts; if it never ends, it hangs at the timeout on its own account."""
    ranks = slots(2)
    ranks[0].answer(Ending.RAISED, exc_type="builtins.ValueError", message="first")
    ranks[0].settle()

    def slow_rank_1() -> None:
        threading.Event().wait(0.6)  # three times the grace
        ranks[1].answer(Ending.RAISED, exc_type="builtins.KeyError", message="its own")
        ranks[1].settle()

    thread = threading.Thread(target=slow_rank_1)
    thread.start()
    end = _run(ranks, timeout_s=30.0)
    thread.join()
    assert [(o.ending, o.message) for o in end.outcomes] == [
        (Ending.RAISED, "first"),
        (Ending.RAISED, "its own"),
    ]
    ranks = slots(2)
    ranks[0].answer(Ending.RAISED, exc_type="builtins.ValueError", message="first")
    end = _run(ranks, timeout_s=1.0)
    peer = end.outcomes[1]
    assert peer.ending is Ending.HUNG and not peer.after_failure
    assert peer.notes == ("still running at the 1 s timeout; killed",)


def test_an_expected_failure_leaves_the_peers_their_whole_bound(slots: Any) -> None:
    from harness.common.expect import raises, returns

    ranks = slots(2)
    ranks[1].answer(
        Ending.RAISED, exc_type="builtins.ValueError", exc_classes=("builtins.ValueError",)
    )
    spec = RankSpec(2, 10.0, expected=(returns(), raises(ValueError)))
    tasks = [RunTask(KEY, s.rank, spec, Target("m", None, "f"), b"", "s", "p/") for s in ranks]

    def rank_0_later() -> None:  # well past the failure grace
        threading.Event().wait(0.6)
        ranks[0].answer(Ending.RETURNED)
        ranks[1].settle()

    thread = threading.Thread(target=rank_0_later)
    thread.start()
    end = RunLoop(ranks, tasks, RunOutput([], None), None, Dumps()).collect()
    thread.join()
    assert [o.ending for o in end.outcomes] == [Ending.RETURNED, Ending.RAISED]
    assert not end.must_close


def test_a_death_is_the_ranks_ending_and_closes_the_pool(slots: Any) -> None:
    ranks = slots(2)
    ranks[0].answer(Ending.RETURNED)
    ranks[1].process.die(-9)
    end = _run(ranks)
    assert end.outcomes[1].ending is Ending.SIGNALLED and end.outcomes[1].signal == 9
    assert end.outcomes[0].ending is Ending.RETURNED
    assert end.must_close


def test_a_collective_called_differently_names_the_odd_rank(slots: Any) -> None:
    ranks = slots(3)
    for slot in ranks:  # every rank called one collective, rank 2 another than the others
        slot.issued = 1
        slot.collectives = ["all_reduce [2] float32"]
    ranks[2].collectives = ["broadcast [2] float32"]
    ranks[0].answer(Ending.RETURNED)  # it returned unreduced data; 1 and 2 are stuck
    end = _run(ranks, timeout_s=30.0)  # the mismatch starts the grace: no 30 s wait
    odd = end.outcomes[2]
    assert odd.ending is Ending.RAISED and odd.exc_type == MISMATCH_TYPE
    assert "called broadcast on a tensor of shape [2] (float32) as collective 1" in odd.message
    assert end.outcomes[1].ending is Ending.HUNG
    assert end.must_close


def test_returned_ranks_give_the_kept_group_up_when_a_peer_issued_more(slots: Any) -> None:
    # Rank 0 returned and kept its group; rank 1 still runs and has issued an operation rank
    # 0 will never match: rank 0 is told to drop the group (so rank 1 fails at once) and
    # no group is kept.
    ranks = slots(2)
    ranks[0].issued, ranks[1].issued = 2, 3
    ranks[0].answer(Ending.RETURNED, kept_group="g1")
    told: list[Any] = []

    def ranks_side() -> None:
        for _ in range(2):  # the RUN task, then what the loop says next (bounded: no hang)
            if ranks[0].rank_end.poll(30):
                told.append(ranks[0].rank_end.recv())
        ranks[1].answer(Ending.RAISED, message="Connection closed by peer")
        ranks[0].settle()  # rank 0 tore the group down and stays
        ranks[1].settle()

    thread = threading.Thread(target=ranks_side)
    thread.start()
    end = _run(ranks, timeout_s=30.0)
    thread.join()
    assert len(told) == 2 and told[1].kind is Kind.DROP_GROUP and told[1].payload.key == KEY
    assert end.states[0].kept_group is None
    assert [o.ending for o in end.outcomes] == [Ending.RETURNED, Ending.RAISED]
    assert not end.must_close


def test_a_slow_peer_that_issued_nothing_more_is_waited_for(slots: Any) -> None:
    ranks = slots(2)
    ranks[0].issued = ranks[1].issued = 2
    ranks[0].answer(Ending.RETURNED, kept_group="g1")

    def slow_rank_1() -> None:
        threading.Event().wait(0.6)  # well past the failure grace: still no failure
        ranks[1].answer(Ending.RETURNED, kept_group="g1")

    thread = threading.Thread(target=slow_rank_1)
    thread.start()
    end = _run(ranks)
    thread.join()
    assert [state.kept_group for state in end.states] == ["g1", "g1"]
    assert not end.must_close


def test_a_rank_that_leaves_after_its_failure_is_replaced_before_the_next_run(
    slots: Any,
) -> None:
    # A rank whose torn-down group something still holds ends after its result. It used to
    # decide that on its own: the next test, already sent to it, then failed ("exited with
    # status 0"). It now says whether it stays, and the run waits for that.
    for leaving in (False, True):
        ranks = slots(2)
        ranks[0].answer(Ending.RETURNED)
        ranks[1].answer(Ending.RAISED)
        ranks[1].settle(key="old-run")
        ranks[1].settle(leaving)
        end = _run(ranks)
        assert [o.ending for o in end.outcomes] == [Ending.RETURNED, Ending.RAISED]
        assert end.must_close is leaving, leaving


def test_a_cut_ends_the_run_with_its_reason(slots: Any) -> None:
    ranks = slots(2)
    cut = Cut()
    cut.after(0.1, "the test that started it failed")
    end = _run(ranks, cut=cut)
    assert [o.ending for o in end.outcomes] == [Ending.HUNG, Ending.HUNG]
    assert "after the test that started it failed; killed" in end.outcomes[0].notes[0]
    assert end.must_close


def test_live_output_never_echoes_the_last_runs_output_nor_skips_this_ones(
    slots: Any,
) -> None:
    # The last run's output is still in the rank's file when this run's task is sent; a
    # rank empties it only once it reads the task. Echoed from the start of the file, the
    # old lines showed under this test, and as many bytes of this test's output were lost.
    ranks = slots(1)
    slot = ranks[0]
    slot.files.stdout.write_bytes(b"the last test's line\n")
    slot.files.stderr.write_bytes(b"")

    def rank() -> None:  # reads its task, prints through its O_APPEND fd 1, returns
        message = slot.rank_end.recv()
        with open(slot.files.stdout, "ab") as out:
            out.write(b"this test's line\n")
        slot.answer(Ending.RETURNED, key=message.payload.key)

    thread = threading.Thread(target=rank)
    thread.start()
    streams = LiveStreams(io.StringIO(), io.StringIO())
    end = _run(ranks, live=streams)
    thread.join()
    assert end.outcomes[0].ending is Ending.RETURNED
    assert streams.out.getvalue() == "\n[rank 0] this test's line\n"
    assert end.outcomes[0].stdout == "this test's line\n"
