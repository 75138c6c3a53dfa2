"""Logic with no rank processes: result routing, root-cause choice, report text."""

from __future__ import annotations

from typing import Any

import pytest

from harness.common.outcome import Ending, RankOutcome
from harness.common.report_text import ReportStyle, render_report, summary_line
from harness.common.root_cause import diagnose

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


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


@pytest.mark.parametrize("world", [3, 4, 6])
def test_a_rank_waiting_alone_while_every_other_returned_is_the_root_cause(world: int) -> None:
    """Rank 2 called all_reduce and no other rank did: it is the odd one out, not the first
    rank that returned; its section (with its stack) leads the report, not only under -v."""
    waiting = 'File "/x/torch/distributed/distributed_c10d.py", line 1 in all_reduce'
    outcomes = [
        _outcome(r, Ending.HUNG, 9.0, stack=waiting) if r == 2 else _outcome(r, Ending.RETURNED, r)
        for r in range(world)
    ]
    diagnosis = diagnose(outcomes, [2])
    others = [r for r in range(world) if r != 2]
    assert (diagnosis.root, diagnosis.collateral, diagnosis.departed) == (2, (), tuple(others))
    assert summary_line(outcomes, diagnosis) == (
        f"rank 2 waited in all_reduce while ranks {', '.join(map(str, others))} returned"
    )
    text = render_report(outcomes, diagnosis, "head", ReportStyle(verbose=False))
    assert "rank 2 (pid 102): hung in all_reduce [root cause]" in text
    assert "-- Python stacks at the deadline --" in text
    assert "[root cause]" not in text.split("[root cause]", 1)[1]


@pytest.mark.parametrize(("world", "left"), [(2, [1]), (4, [3]), (4, [2, 3])])
def test_ranks_that_returned_while_as_many_or_more_waited_are_the_root_cause(
    world: int, left: list[int]
) -> None:
    """The other side: a rank forgot the collective its peers wait in."""
    waiting = 'File "/x/torch/distributed/distributed_c10d.py", line 1 in all_reduce'
    outcomes = [
        _outcome(r, Ending.RETURNED, 1.0 + r)
        if r in left
        else _outcome(r, Ending.HUNG, 9.0, stack=waiting)
        for r in range(world)
    ]
    stayed = [r for r in range(world) if r not in left]
    diagnosis = diagnose(outcomes, stayed)
    assert (diagnosis.root, diagnosis.departed, diagnosis.collateral) == (
        left[0],
        tuple(left),
        tuple(stayed),
    )


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


@pytest.mark.parametrize(
    ("innermost", "before"),
    [
        ('  File "/x/lib/rankwise/_watch.py", line 437 in wait', False),  # under the peer watch
        (
            '  File "/x/torch/distributed/distributed_c10d.py", line 5100 in all_to_all_single',
            False,
        ),
        ('  File "/x/tests/test_a.py", line 12 in slow_fn', True),  # still in its own fn
    ],
)
def test_a_rank_waiting_for_its_exchange_is_not_hung_before_it(
    innermost: str, before: bool
) -> None:
    stack = f'  File "/x/lib/rankwise/_collectives.py", line 90 in all_reduce\n{innermost}\n'
    hung = RankOutcome("k", 0, 100, Ending.HUNG, stack=stack, where="all_reduce('batch')")
    assert hung.before_exchange is before
    assert hung.describe() == (
        "hung in all_reduce('batch'), before its exchange" if before else
        "hung in all_reduce('batch')"
    )  # fmt: skip
