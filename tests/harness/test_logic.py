"""Logic with no rank processes: result routing, root-cause choice, report text."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

from harness.common.outcome import Ending, RankOutcome, diagnose, summary_line
from harness.common.protocol import Kind, Message, RankFiles, RankSpec, RunTask, Target
from harness.warm.pool import _Run


class _FakeProcess:
    def __init__(self) -> None:
        self._reader, self._writer = multiprocessing.Pipe(duplex=False)
        self.sentinel = self._reader  # never ready: the "rank" stays alive
        self.exitcode = None

    def is_alive(self) -> bool:
        return True


class _FakeSlot:
    def __init__(self, rank: int) -> None:
        self.rank, self.pid = rank, os.getpid()
        self.conn, self.rank_end = multiprocessing.Pipe()
        self.process = _FakeProcess()
        self.files = RankFiles.in_dir(Path("/nonexistent"), rank)  # the test replaces dump_stacks

    def read_output(self) -> str:
        return ""

    def read_where(self) -> str:
        return ""

    def board(self, size: int = 0) -> bytes:  # no operations board: no collective seen
        return b""

    def collectives_called(self) -> int:
        return 0

    def clear_board(self) -> None:
        pass

    def read_issued(self) -> int:
        return 0

    def read_collectives(self) -> tuple[int, dict[int, str]]:
        return 0, {}


class _FakePool:
    def __init__(self, size: int) -> None:
        self.slots = [_FakeSlot(r) for r in range(size)]
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _task(key: str, rank: int = 0) -> RunTask:
    target = Target("tests.harness.test_logic", None, "_task")
    return RunTask(key, rank, RankSpec(1, 10.0), target, b"", "127.0.0.1", 1, "p/")


def test_a_late_result_of_an_earlier_run_is_never_credited() -> None:
    pool = _FakePool(2)
    for slot in pool.slots:  # each rank first answers an old run, then this one
        slot.rank_end.send(
            Message(Kind.RESULT, RankOutcome("old-run", slot.rank, 1, Ending.RAISED))
        )
        slot.rank_end.send(
            Message(Kind.RESULT, RankOutcome("this-run", slot.rank, 1, Ending.RETURNED))
        )
    run = _Run(pool, [_task("this-run", 0), _task("this-run", 1)], timeout_s=10)  # type: ignore[arg-type]
    outcomes = run.collect()
    assert [(o.key, o.ending) for o in outcomes] == [("this-run", Ending.RETURNED)] * 2
    assert not pool.closed


def test_only_late_results_mean_a_hang() -> None:
    pool = _FakePool(1)
    pool.slots[0].rank_end.send(Message(Kind.RESULT, RankOutcome("old-run", 0, 1, Ending.RETURNED)))
    import harness.warm.pool as pool_module

    dumped: list[Any] = []
    original = pool_module.dump_stacks
    pool_module.dump_stacks = lambda ranks: dumped.append(ranks) or {}  # type: ignore[assignment]
    try:
        outcomes = _Run(pool, [_task("this-run")], timeout_s=0.3).collect()  # type: ignore[arg-type]
    finally:
        pool_module.dump_stacks = original
    assert outcomes[0].ending is Ending.HUNG and outcomes[0].key == "this-run"
    assert dumped and pool.closed


def test_live_output_never_echoes_the_last_runs_output_nor_skips_this_ones(tmp_path: Path) -> None:
    # The last run's output is still in the rank's file when this run's task is sent; a
    # rank empties it only once it reads the task. Echoed from the start of the file, the
    # old lines showed under this test, and as many bytes of this test's output were lost.
    import io
    import threading

    from harness.warm.pool import LiveStreams

    pool = _FakePool(1)
    slot = pool.slots[0]
    slot.files = RankFiles.in_dir(tmp_path, 0)
    slot.files.stdout.write_bytes(b"the last test's line\n")
    slot.files.stderr.write_bytes(b"")

    def rank() -> None:  # reads its task, prints through its O_APPEND fd 1, returns
        message = slot.rank_end.recv()
        with open(slot.files.stdout, "ab") as out:
            out.write(b"this test's line\n")
        slot.rank_end.send(
            Message(Kind.RESULT, RankOutcome(message.payload.key, 0, 1, Ending.RETURNED))
        )

    thread = threading.Thread(target=rank)
    thread.start()
    streams = LiveStreams(io.StringIO(), io.StringIO())
    outcomes = _Run(pool, [_task("this-run")], timeout_s=10, live=streams).collect()  # type: ignore[arg-type]
    thread.join()
    assert outcomes[0].ending is Ending.RETURNED
    assert streams.out.getvalue() == "\n[rank 0] this test's line\n"
    assert outcomes[0].stdout == "this test's line\n"


def _outcome(rank: int, ending: Ending, at: float, **fields: Any) -> RankOutcome:
    return RankOutcome("k", rank, 100 + rank, ending, at=at, **fields)


def test_root_cause_is_the_first_failure_a_peer_did_not_cause() -> None:
    collateral = dict(
        exc_type="torch.distributed.DistBackendError", message="Connection closed by peer"
    )
    outcomes = [
        _outcome(0, Ending.RAISED, 1.0, **collateral),  # first in time, but caused by rank 2
        _outcome(1, Ending.RETURNED, 1.5),
        _outcome(2, Ending.SIGNALLED, 2.0, signal=9),
        _outcome(3, Ending.RAISED, 3.0, exc_type="builtins.ValueError", message="own bug"),
    ]
    diagnosis = diagnose(outcomes, [0, 2, 3])
    assert (diagnosis.root, diagnosis.collateral, diagnosis.independent) == (2, (0,), (3,))
    assert summary_line(outcomes, diagnosis) == (
        "rank 2 failed: died of SIGKILL; rank 3 also failed; rank 0 collateral"
    )


def test_a_rank_outside_any_collective_is_the_root_of_a_hang() -> None:
    waiting = 'File "/x/torch/distributed/distributed_c10d.py", line 1 in all_gather'
    outcomes = [
        _outcome(0, Ending.HUNG, 5.0, stack=waiting),
        _outcome(1, Ending.HUNG, 5.0, stack='File "/x/train.py", line 3 in step'),
    ]
    diagnosis = diagnose(outcomes, [0, 1])
    assert (diagnosis.root, diagnosis.collateral) == (1, (0,))
    assert outcomes[0].describe() == "hung in all_gather"


def test_a_group_a_release_thread_is_still_freeing_is_not_taken_for_held() -> None:
    # On a loaded machine a release thread can take more than the bound to free its group.
    # The group was then taken for held by something the test left, and the rank ended
    # after its result: the next test, already sent to it, failed ("exited with status 0").
    import threading
    import weakref

    from harness.rank import group_release

    class Group:  # stands for a gloo group: weakly referenced, freed by a release thread
        pass

    held: list[Any] = [Group()]
    go = threading.Event()

    def free() -> None:
        go.wait(30)
        held.clear()

    thread = threading.Thread(target=free, name=group_release._RELEASE_THREAD, daemon=True)
    saved = group_release._destroyed[:]
    group_release._destroyed[:] = [weakref.ref(held[0])]
    thread.start()
    try:
        assert not group_release.still_held(0.05)  # still being freed: not held
        go.set()
        thread.join(5)
        assert not group_release.still_held(0.05)  # freed
        kept = Group()  # something the test left holds this one: held
        group_release._destroyed[:] = [weakref.ref(kept)]
        assert group_release.still_held(0.05)
    finally:
        go.set()
        group_release._destroyed[:] = saved


def test_a_rank_that_leaves_after_its_failure_is_replaced_before_the_next_run() -> None:
    # A rank whose torn-down group something still holds ends after its result. It used to
    # decide that on its own: the next test, already sent to it, then failed ("exited with
    # status 0"). It now says whether it stays, and the run waits for that.
    from harness.common.protocol import Settled

    for leaving in (False, True):
        pool = _FakePool(2)
        for slot in pool.slots:
            ending = Ending.RAISED if slot.rank == 1 else Ending.RETURNED
            outcome = RankOutcome("this-run", slot.rank, 1, ending)
            slot.rank_end.send(Message(Kind.RESULT, outcome))
        pool.slots[1].rank_end.send(Message(Kind.SETTLED, Settled("old-run", False)))
        pool.slots[1].rank_end.send(Message(Kind.SETTLED, Settled("this-run", leaving)))
        tasks = [_task("this-run", 0), _task("this-run", 1)]
        outcomes = _Run(pool, tasks, timeout_s=10).collect()  # type: ignore[arg-type]
        assert [o.ending for o in outcomes] == [Ending.RETURNED, Ending.RAISED]
        assert pool.closed is leaving, leaving


def test_the_tests_own_group_still_being_freed_on_a_busy_machine_is_not_taken_for_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A group the test set up itself is held until its release thread is done (its store may
    # listen on a port the next test wants). Freeing takes ~20 ms; on a saturated machine it
    # took seconds, and the rank was replaced with a warning (an error under -W error).
    import weakref

    from harness.rank import group_release

    class Group:
        pass

    held: list[Any] = [Group()]

    class SlowRelease:  # a release thread that ends once 3 s of waiting were allowed
        name = group_release._RELEASE_THREAD
        done = False

        def join(self, timeout: float | None = None) -> None:
            if timeout is None or timeout >= 3.0:
                self.done = True
                held.clear()

        def is_alive(self) -> bool:
            return not self.done

    monkeypatch.setattr(group_release.threading, "enumerate", lambda: [SlowRelease()])
    monkeypatch.setattr(group_release, "_destroyed", [weakref.ref(held[0])])
    assert not group_release.held_after_test(strict=True)
