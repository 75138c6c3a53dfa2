"""Whatever a rank writes is bounded: in the pytest process's memory (live output under -s
read in bounded chunks, an unfinished line capped), on disk (a rank's output file keeps its
head and its tail, saying what was cut), and in time (the test's bound fires whatever a rank
writes). And a session stopped as CI stops one leaves nothing in TMPDIR.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.conftest import shell_job_running_pytest, wait_until

FLOODS = """
import os, sys, threading
import pytest

# Each rank writes 2 GB at most, then waits: were the harness's bound not to fire, the run
# could not fill the disk (a flood without a newline wrote 79 GB in 4 minutes).
@pytest.mark.ranks(2, timeout=3)
def test_lines(rank):
    line = "x" * 100 + "\\n"
    for _ in range(20_000_000):
        sys.stdout.write(line)
    threading.Event().wait()

@pytest.mark.ranks(2, timeout=3)
def test_no_newline(rank):
    for _ in range(32_000):
        os.write(1, b"y" * 65536)
    threading.Event().wait()

def test_after():
    pass
"""
# A pytest process that floods with -s took 3.7-8.2 GB; a plain session with torch and the
# ranks' outcomes takes a few hundred MB. The bound is far from both.
MEMORY_BOUND_KB = 1536 * 1024


def _run(path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "harness", str(path), *args],
        cwd=path,
        capture_output=True,
        text=True,
        timeout=timeout,
        errors="replace",
    )


@pytest.mark.slow
@pytest.mark.parametrize("test", ["test_lines", "test_no_newline"])
def test_a_flood_under_dash_s_ends_at_the_tests_bound_in_bounded_memory(
    pytester: pytest.Pytester, test: str
) -> None:
    pytester.makepyfile(FLOODS)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # The outer bound is a safety net: a flood without a newline used to run for good.
    result = _run(pytester.path, "-s", "-k", f"{test} or test_after", timeout=240)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    tail = result.stdout[-3000:]
    assert "1 failed, 1 passed" in tail, tail
    assert "still running at the 3 s timeout; killed" in result.stdout, tail
    assert peak < MEMORY_BOUND_KB or peak == before, f"pytest grew to {peak} KB"


@pytest.mark.slow
def test_a_ranks_output_file_keeps_its_head_and_tail_and_says_what_was_cut(
    pytester: pytest.Pytester,
) -> None:
    """The file a rank's stdout goes to stays bounded while the test runs (it grew to 12 GB),
    and the report keeps its first and last lines, saying how much was left out."""
    pytester.makepyfile(
        """
        import os, time
        import pytest

        @pytest.mark.ranks(2, timeout=120)
        def test_writes_a_lot(rank):
            os.write(1, b"first line\\n")
            chunk = b"z" * 1023 + b"\\n"
            for _ in range(64 * 1024):  # 64 MiB
                os.write(1, chunk)
            deadline = time.monotonic() + 60  # a safety net: the harness cuts it at once
            while os.fstat(1).st_size > 32 * 1024 * 1024 and time.monotonic() < deadline:
                time.sleep(0.05)
            size = os.fstat(1).st_size
            os.write(1, b"last line\\n")
            assert size <= 32 * 1024 * 1024, f"the output file holds {size} bytes"
            assert rank == 7  # fail, so the report shows the output
        """
    )
    result = _run(pytester.path, "-rA")
    text = result.stdout
    assert "1 failed" in text[-2000:], text[-3000:]
    assert "the output file holds" not in text, text[-3000:]
    assert "first line" in text and "last line" in text
    assert "bytes cut" in text


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGHUP", "SIGTERM to the group", "SIGKILL"])
def test_a_stopped_session_leaves_nothing_in_tmpdir(
    pytester: pytest.Pytester, tmp_path: Path, how: str
) -> None:
    """CI cancels a job with SIGTERM (SIGHUP when a terminal closes; SIGKILL at last): the
    session's work directory (ranks' files, 196 MB after a flood) and multiprocessing's
    pymp-XXXX directory were left in TMPDIR; after a normal end or SIGINT they are gone."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    pytester.makepyfile(
        """
        import os, threading
        import pytest

        @pytest.mark.ranks(2, timeout=120)
        def test_waits(rank):
            open(os.path.join(os.environ["MARKS"], f"rank{rank}"), "w").close()
            threading.Event().wait()
        """
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "MARKS": str(marks)}
    proc = subprocess.Popen(
        shell_job_running_pytest("-p", "harness", str(pytester.path)),
        cwd=pytester.path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: len(list(marks.iterdir())) == 2, 120, "both ranks to start")
        assert [p.name for p in tmpdir.iterdir() if p.name.startswith("harness-")]
        if how.endswith(" to the group"):
            os.killpg(proc.pid, getattr(signal, how.split()[0]))
        else:
            proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
        left = lambda: sorted(  # noqa: E731
            p.name for p in tmpdir.iterdir() if p.name.startswith(("harness-", "pymp-"))
        )
        wait_until(lambda: not left(), 30, f"the session's directories to go: {left()}")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_the_next_session_removes_what_a_killed_one_left(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """A session killed with SIGKILL whose fork server could not clean up (it was killed
    too) left its directories: the next session in that TMPDIR removes them, and only
    those of sessions that are gone."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    stale = tmpdir / "harness-stale"
    stale.mkdir(mode=0o700)
    (stale / "owner").write_text(f"{_dead_pid()} 0\n")
    (stale / "rank0.out").write_bytes(b"x" * 1024)
    live = tmpdir / "harness-live"
    live.mkdir(mode=0o700)
    (live / "owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_ok(rank):
            pass
        """
    )
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "harness", str(pytester.path)],
        cwd=pytester.path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    assert not stale.exists()
    assert live.exists()


def _dead_pid() -> int:
    """A pid no process has now (a child that has ended and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
