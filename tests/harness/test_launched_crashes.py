"""A launched rank's fatal signal, named by a rank beside it on its node (crashes.py): what it
reads, what it publishes, and what it leaves alone. No launch: the ranks are plain processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import pytest

from harness.launched import crashes
from harness.launched.crashes import Crashes, report_path

SEGFAULT = """
import ctypes, faulthandler, sys
faulthandler.enable(file=open(sys.argv[1], "w"), all_threads=False)
def deep_in_the_test():
    ctypes.string_at(0)
deep_in_the_test()
"""


@pytest.fixture
def job() -> Iterator[str]:
    name = f"job-{uuid.uuid4()}"
    yield name
    for rank in range(8):
        path = report_path(name, rank)
        if path is not None:
            path.unlink(missing_ok=True)


def _dead(argv: list[str]) -> int:
    proc = subprocess.Popen(argv)
    proc.wait(timeout=60)
    return proc.pid


def _look(watcher: Crashes) -> tuple[dict[int, dict[str, object]], list[str]]:
    published: dict[int, dict[str, object]] = {}
    said: list[str] = []
    watcher.look(lambda rank, text: published.__setitem__(rank, json.loads(text)), said.append)
    return published, said


def test_a_rank_beside_that_died_of_sigsegv_is_named_once_with_its_stack(job: str) -> None:
    path = report_path(job, 5)
    assert path is not None
    script = textwrap.dedent(SEGFAULT)
    pid = _dead([sys.executable, "-c", script, str(path)])
    watcher = Crashes(job, 4, {5: pid})
    published, said = _look(watcher)
    assert set(published) == {5}
    died = published[5]
    assert died["signal"] == 11 and died["code"] is None
    assert str(died["text"]).startswith("killed by SIGSEGV (seen by rank 4 on its node)")
    assert "deep_in_the_test" in str(died["text"])
    assert len(said) == 1 and f"rank 5 (pid {pid}) died, killed by SIGSEGV" in said[0]
    assert not path.exists()  # read once, then gone
    assert _look(watcher) == ({}, [])  # named once


def test_a_rank_that_ended_without_a_crash_report_is_left_to_its_peers(job: str) -> None:
    watcher = Crashes(job, 0, {1: _dead([sys.executable, "-c", "pass"])})
    assert _look(watcher) == ({}, [])


def test_a_living_rank_is_not_read(job: str) -> None:
    path = report_path(job, 1)
    assert path is not None
    path.write_text("Fatal Python error: Segmentation fault\n")
    assert _look(Crashes(job, 0, {1: os.getpid()})) == ({}, [])


def test_a_rank_alone_on_its_node_keeps_faulthandler_as_it_was(job: str) -> None:
    import faulthandler

    before = faulthandler.is_enabled()
    Crashes(job, 0, {}).watch_own()
    assert faulthandler.is_enabled() == before
    assert report_path(job, 0) is not None and not report_path(job, 0).exists()  # type: ignore[union-attr]


def test_a_session_that_ends_leaves_no_report_file(job: str) -> None:
    """Each rank's (empty) report file goes at the session's end: none piles up in the
    user's temporary directory, session after session."""
    path = report_path(job, 0)
    assert path is not None
    code = textwrap.dedent(
        f"""
        from harness.launched.crashes import Crashes
        from pathlib import Path
        crashes = Crashes({job!r}, 0, {{1: 1}})
        crashes.watch_own()
        assert Path({str(path)!r}).exists()
        crashes.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert not path.exists()


def test_the_reports_directory_is_this_users_alone(job: str) -> None:
    path = report_path(job, 0)
    assert path is not None
    directory = path.parent
    assert directory.stat().st_mode & 0o777 == 0o700 and directory.stat().st_uid == os.getuid()
    directory.chmod(0o777)  # opened to others (by someone else, say): not used
    try:
        assert report_path(job, 0) is None
    finally:
        directory.chmod(0o700)
    assert crashes.report_path(job, 0) == path
