"""One thread keeps a launched rank's test bounds: each fires once its time passes, on a thread
of its own, unless withdrawn first; an earlier one added later is not held back by a later one
pending, nor by a callback that blocks."""

from __future__ import annotations

import threading
import time

import pytest

from harness.launched import deadlines as deadlines_module
from harness.launched.deadlines import Deadlines

pytestmark = pytest.mark.unit


def test_a_deadline_fires_once_its_time_passes_on_a_thread_named_for_it() -> None:
    deadlines = Deadlines()
    fired = threading.Event()
    seen: list[tuple[str, float]] = []
    started = time.monotonic()

    def expired() -> None:
        seen.append((threading.current_thread().name, time.monotonic() - started))
        fired.set()

    deadlines.add(0.05, expired, "harness-hang-timer")
    assert fired.wait(30)
    assert seen[0][0] == "harness-hang-timer" and seen[0][1] >= 0.05
    assert len(seen) == 1


def test_a_withdrawn_deadline_never_fires_and_the_others_still_do() -> None:
    deadlines = Deadlines()
    withdrawn, kept = threading.Event(), threading.Event()
    token = deadlines.add(0.05, withdrawn.set, "withdrawn")
    deadlines.withdraw(token)
    deadlines.add(0.1, kept.set, "kept")
    assert kept.wait(30)
    assert not withdrawn.is_set()  # it was due before the one that fired


def test_an_earlier_deadline_added_after_a_later_one_fires_first() -> None:
    deadlines = Deadlines()
    order: list[str] = []
    early = threading.Event()

    def fired(name: str) -> None:
        order.append(name)
        early.set()

    deadlines.add(600.0, lambda: fired("late"), "late")  # the thread sleeps until it
    deadlines.add(0.05, lambda: fired("early"), "early")
    assert early.wait(30) and order == ["early"]


def test_a_callback_that_blocks_holds_back_no_other() -> None:
    deadlines = Deadlines()
    release, second = threading.Event(), threading.Event()

    def blocks() -> None:
        release.wait(60)

    deadlines.add(0.01, blocks, "blocks")
    deadlines.add(0.05, second.set, "second")
    try:
        assert second.wait(30)
    finally:
        release.set()


def test_a_deadline_after_the_idle_wake_up_is_added_without_waking_and_still_fires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(deadlines_module, "_IDLE_WAKE_S", 0.1)
    deadlines = Deadlines()
    deadlines.withdraw(deadlines.add(0.0, lambda: None, "started"))  # the thread sleeps, idle
    fired = threading.Event()
    started = time.monotonic()
    deadlines.add(0.3, fired.set, "later than its wake-up")
    assert fired.wait(30) and time.monotonic() - started >= 0.3
