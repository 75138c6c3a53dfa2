"""The harness's own store calls print no C++ warning when they fail (torch logs every failed
store call with its frames before raising); everyone else's calls keep torch's warnings."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from harness.launched import quiet_cpp

STORE_SERVER = """
import time
from datetime import timedelta
from typing import Any
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


def _level() -> int:
    flag = quiet_cpp._flag_once()
    assert flag is not None, "c10's log level not found in libc10"
    return flag.value


@pytest.fixture
def gone_store() -> Iterator[Any]:
    """A client whose store's process was killed (every call on it fails)."""
    server = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, None, False, timedelta(seconds=10)
        )
        client.set("k", "1")
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()
    yield client


def test_a_failed_call_under_quiet_prints_nothing_and_one_outside_does(
    gone_store: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    with quiet_cpp.quiet(), pytest.raises(dist.DistNetworkError):
        gone_store.check(["k"])
    assert capfd.readouterr().err == ""
    with pytest.raises(dist.DistNetworkError):
        gone_store.check(["k"])  # a user's own call: torch's warning as torch prints it
    assert "[c10d]" in capfd.readouterr().err


def test_the_level_is_raised_while_a_call_runs_and_put_back_after() -> None:
    before = _level()
    with quiet_cpp.quiet():
        assert _level() == max(before, 2)
        with quiet_cpp.quiet():
            assert _level() == max(before, 2)
        assert _level() == max(before, 2)  # the outer call still runs
    assert _level() == before


def test_a_level_set_higher_by_the_user_is_kept() -> None:
    flag = quiet_cpp._flag_once()
    assert flag is not None
    before = flag.value
    flag.value = 3  # TORCH_CPP_LOG_LEVEL=FATAL
    try:
        with quiet_cpp.quiet():
            assert flag.value == 3
        assert flag.value == 3
    finally:
        flag.value = before


def test_calls_on_two_threads_share_one_raise() -> None:
    before = _level()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with quiet_cpp.quiet():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(30)
    with quiet_cpp.quiet():
        pass
    assert _level() == max(before, 2)  # the other thread's call still runs
    leave.set()
    thread.join(30)
    assert _level() == before


def test_a_call_left_behind_is_released_and_its_end_changes_nothing() -> None:
    """A call blocked on a cut link, given up on by its caller: the level goes back at once,
    and the call's own end (minutes later) neither lowers nor raises it."""
    before = _level()
    inside, leave = threading.Event(), threading.Event()

    def blocked() -> None:
        with quiet_cpp.quiet():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=blocked)
    thread.start()
    assert inside.wait(30)
    quiet_cpp.release()
    assert _level() == before
    with quiet_cpp.quiet():  # a later call raises and restores as usual
        assert _level() == max(before, 2)
    assert _level() == before
    leave.set()
    thread.join(30)
    assert _level() == before
