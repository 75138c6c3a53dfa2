"""Helpers for testing the plugin as a plugin: inner pytest runs over generated test files."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.common.outcome import Ending, RankOutcome

# Files the DeepSpeed adoption tests copy into their pytester directories, not tests here.
collect_ignore = ["deepspeed_like"]

# The imports every generated rank test file starts with.
HEADER = """
import os, signal, sys, threading, pytest, torch, torch.distributed as dist
import rankwise as rw
from harness import aborts, exits, hangs, killed, raises, returns
"""


def outcome(rank: int, ending: Ending = Ending.RETURNED, **fields: Any) -> RankOutcome:
    """A rank's outcome of test "t0", as a unit test of the pytest side fakes it."""
    return RankOutcome("t0", rank, 100 + rank, ending, **fields)


def shell_job_running_pytest(*args: str) -> list[str]:
    """`python -m pytest *args`, started with SIGINT and SIGHUP at their defaults, as a shell
    starts a job: under `nohup make test-slow &` this process ignores both (nohup ignores
    SIGHUP; a background job of a non-interactive shell ignores SIGINT), and a child
    inherits that, so an inner session would not stop on the Ctrl-C or hang-up a test sends."""
    trampoline = (
        "import os, signal, sys; "
        "[signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGHUP)]; "
        "os.execv(sys.executable, [sys.executable, '-m', 'pytest', *sys.argv[1:]])"
    )
    return [sys.executable, "-c", trampoline, *args]


def alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_until(condition: object, timeout: float, what: str) -> None:
    """Poll `condition()` until true; fail after `timeout` seconds saying what never happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def read_pids(directory: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(directory.glob("pid-*")) if p.read_text().strip()]


def assert_all_gone(pids: Iterable[int], timeout: float = 10.0) -> None:
    pids = list(pids)
    assert pids, "no pids were recorded"
    wait_until(lambda: not any(alive(p) for p in pids), timeout, f"processes {pids} to exit")


def kill_quietly(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def inner(pytester: pytest.Pytester) -> Iterator[pytest.Pytester]:
    """A pytester whose runs load the harness and never wait on a test for long.

    The inner runs share this process: what their parent-side code sets in the environment
    (torch's test bases set WORLD_SIZE in setUp) is undone after the test. Their terminal
    is 160 columns wide, whatever this one's.
    """
    pytester.makeini("[pytest]\nrank_timeout = 30\n")
    saved = dict(os.environ)
    # pytest cuts the short summary's " - reason" to the terminal's width: a narrow terminal
    # (COLUMNS below ~80 on a CI runner) would cut what the tests match.
    os.environ["COLUMNS"] = "160"
    yield pytester
    os.environ.clear()
    os.environ.update(saved)


# In-process pytester runs restore sys.modules afterwards; import what the inner runs load
# (torch, the ranks' entry point) here once, so it is never unloaded between runs. The
# functional collectives register autograd kernels when imported: imported again by a later
# inner run (an FSDP or DTensor test file), they warn, and warnings are errors here.
import torch.distributed  # noqa: E402
import torch.distributed._functional_collectives  # noqa: E402
import torch.distributed.fsdp  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401

import harness.rank.worker  # noqa: E402
import harness.warm.pools  # noqa: E402,F401
