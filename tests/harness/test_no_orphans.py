"""No process outlives its test or pytest: children, grandchildren, in the rank's session or
in new ones, after a normal end, Ctrl-C, SIGTERM or SIGKILL of pytest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.conftest import (
    alive,
    assert_all_gone,
    kill_quietly,
    shell_job_running_pytest,
    wait_until,
)

# Each rank starts a child in its own session, one in a new session, and a grandchild
# orphaned at once (its parent exits) in a new session; it records their pids.
STARTS_CHILDREN = """
import os, subprocess, sys, pytest

SLEEP = "import time; time.sleep(600)"

def start_children(tag):
    pids = []
    pids.append(subprocess.Popen([sys.executable, "-c", SLEEP, tag + "-same"]).pid)
    pids.append(
        subprocess.Popen([sys.executable, "-c", SLEEP, tag + "-new"], start_new_session=True).pid
    )
    spawner = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEP!r}, {tag!r} + '-orphan'], "
        "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(p.pid)"
    )
    out = subprocess.run([sys.executable, "-c", spawner], capture_output=True, text=True)
    pids.append(int(out.stdout))
    with open(f"child-{tag}", "w") as f:
        f.write(" ".join(map(str, pids)))
"""


def _children(directory: Path) -> list[int]:
    return [int(p) for f in sorted(directory.glob("child-*")) for p in f.read_text().split()]


def test_processes_a_test_leaves_are_killed_and_reported(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        STARTS_CHILDREN
        + """
@pytest.mark.ranks(2)
def test_leaves_children(rank):
    start_children(f"r{rank}")

@pytest.mark.ranks(2)
@pytest.mark.allow_leftovers("processes")
def test_allowed(rank):
    start_children(f"allowed{rank}")

@pytest.mark.ranks(2)
def test_next_is_clean(rank):
    pass
"""
    )
    result = inner.runpytest("-p", "harness", "-v")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaves_children*",
            "*hygiene: rank 0 left processes running (the harness killed them): pid *"
            "time.sleep(600) r0-same*r0-new*r0-orphan*",
            "*allow_leftovers('processes')*",
        ]
    )
    pids = _children(inner.path)
    assert len(pids) == 12
    assert not [p for p in pids if alive(p)]  # killed at each test's end, allowed or not


def test_forked_copies_of_a_rank_are_leftovers_too(inner: pytest.Pytester) -> None:
    """A child made by os.fork (no exec) or by a forkserver the test started carries a
    helper's command line (the rank's own, or the forkserver's): it is still a leftover."""
    inner.makepyfile(
        """
        import multiprocessing, os, threading, pytest

        def sleep_long():
            threading.Event().wait(600)

        @pytest.mark.ranks(2)
        def test_forks(rank):
            if rank == 1:
                pid = os.fork()
                if pid == 0:
                    sleep_long()
                    os._exit(0)
                open("forked", "w").write(str(pid))

        @pytest.mark.ranks(2)
        def test_forkserver_child(rank):
            if rank == 1:
                child = multiprocessing.get_context("forkserver").Process(target=sleep_long)
                child.start()
                open("served", "w").write(str(child.pid))
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(
        ["*hygiene: rank 1 left processes running (the harness killed them): pid *"] * 2
    )
    for name in ("forked", "served"):
        assert not alive(int((inner.path / name).read_text()))


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    # To the group: what `timeout`, a CI job's cancel or a closed terminal sends; the fork
    # server (in pytest's group) got it too, and died without killing the ranks' children.
    # SIGKILL to the group (a CI runner's last word) killed it before it could: what the
    # ranks started lived on under PID 1.
    [
        "SIGINT",
        "SIGTERM",
        "SIGKILL",
        "normal end",
        "SIGTERM to the group",
        "SIGHUP to the group",
        "SIGKILL to the group",
    ],
)
def test_no_descendant_outlives_pytest(pytester: pytest.Pytester, how: str) -> None:
    hang = "(timeout=3)" if how == "normal end" else "(timeout=120)"
    pytester.makepyfile(
        STARTS_CHILDREN
        + f"""
import threading

@pytest.mark.ranks{hang}
def test_hangs_with_children(rank):
    start_children(f"r{{rank}}")
    threading.Event().wait()
"""
    )
    proc = subprocess.Popen(
        shell_job_running_pytest("-p", "harness", str(pytester.path)),
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, as under a shell's job control
    )
    try:
        wait_until(lambda: len(_children(pytester.path)) == 6, 60, "every rank's children")
        pids = _children(pytester.path)
        if how.endswith(" to the group"):
            os.killpg(proc.pid, getattr(signal, how.split()[0]))
        elif how != "normal end":
            proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
        assert_all_gone(pids)
    finally:
        proc.kill()
        proc.wait()
        kill_quietly(_children(pytester.path))


@pytest.mark.slow
def test_the_fork_server_is_gone_when_pytest_exits(pytester: pytest.Pytester) -> None:
    # It used to end only after pytest had exited, tearing torch down for a second or so:
    # a CI step that checks for stray processes right after pytest would find it. So did
    # multiprocessing's resource tracker, started with it.
    pytester.makeconftest(
        """
import multiprocessing.resource_tracker, pytest
from harness.warm import forkserver

@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    pid = forkserver._server._forkserver_pid  # the harness's own server
    open("forkserver.pid", "w").write(str(pid))
    pid = multiprocessing.resource_tracker._resource_tracker._pid
    open("tracker.pid", "w").write(str(pid))
"""
    )
    pytester.makepyfile(
        """
import pytest

@pytest.mark.ranks(2)
def test_something(rank):
    pass
"""
    )
    proc = _pytest_in_a_process(pytester)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    server = int((pytester.path / "forkserver.pid").read_text())
    tracker = int((pytester.path / "tracker.pid").read_text())
    try:
        assert not alive(server), "the fork server outlived the pytest process"
        assert not alive(tracker), "the resource tracker outlived the pytest process"
    finally:
        kill_quietly([server, tracker])


@pytest.mark.ranks(2)
def test_a_rank_ends_on_sigterm_and_sighup_as_any_process_does() -> None:
    # Forked from the fork server, a rank would otherwise carry its handlers, which kill
    # the caller's whole tree. (Under nohup the pytest process, and so a rank, ignores
    # SIGHUP from its start, as any child of it does.)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    expected = signal.SIG_IGN if _ignored_by_pytest(signal.SIGHUP) else signal.SIG_DFL
    assert signal.getsignal(signal.SIGHUP) is expected


def _ignored_by_pytest(sig: int) -> bool:
    """Whether the pytest process (the parent of this rank's fork server) ignores `sig`."""
    stat = Path(f"/proc/{os.getppid()}/stat").read_text()
    pytest_pid = int(stat.rsplit(")", 1)[1].split()[1])
    for line in Path(f"/proc/{pytest_pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.slow
def test_a_grandchild_of_a_rank_that_died_does_not_outlive_pytest(
    pytester: pytest.Pytester,
) -> None:
    """A rank starts a child in a new session and ends with os._exit: the child passes to
    the fork server (a subreaper), which the session's end killed with SIGKILL, so its own
    kill-my-tree step never ran and the child outlived pytest."""
    pytester.makepyfile(
        """
import os, subprocess, sys, pytest

@pytest.mark.ranks(2)
def test_dies_leaving_a_child(rank):
    if rank == 1:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
        )
        with open("child-r1", "w") as f:
            f.write(str(child.pid))
        os._exit(3)
"""
    )
    proc = _pytest_in_a_process(pytester)
    pids = _children(pytester.path)
    try:
        assert proc.returncode == 1 and len(pids) == 1, proc.stdout + proc.stderr
        assert_all_gone(pids)
    finally:
        kill_quietly(pids)


def _pytest_in_a_process(pytester: pytest.Pytester) -> subprocess.CompletedProcess[str]:
    """A whole pytest session over `pytester`'s files, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "harness", str(pytester.path)],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_processes_ending_on_their_own_are_not_leftovers(inner: pytest.Pytester) -> None:
    """A child that has given its output and is on its way out when the body returns (it
    still runs: an atexit handler, the rest of a pipeline, DeepSpeed's test base reading
    /proc/cpuinfo through `cat | grep | sort -u | wc -l` without waiting for the first three)
    is no leftover: the check waits while such a process still runs (not while one sleeps).
    One that never stops running is still a leftover, at the test's bound."""
    inner.makepyfile(
        """
        import shlex, subprocess, sys, pytest

        # Prints, closes its stdout (the reader sees the end), then keeps the CPU a while.
        BUSY_AFTER_OUTPUT = (
            "import os, time; print('done', flush=True); os.close(1)\\n"
            "while time.process_time() < 0.5: pass"
        )

        @pytest.mark.ranks(2)
        def test_reads_a_child_that_then_ends(rank):
            child = subprocess.Popen([sys.executable, "-c", BUSY_AFTER_OUTPUT],
                                     stdout=subprocess.PIPE)
            assert child.stdout.read() == b"done\\n"

        @pytest.mark.ranks(2)
        def test_pipelines_like_deepspeeds(rank):
            for _ in range(20):
                p1 = subprocess.Popen(shlex.split("cat /proc/cpuinfo"), stdout=subprocess.PIPE)
                p2 = subprocess.Popen(["grep", "processor"], stdin=p1.stdout,
                                      stdout=subprocess.PIPE)
                p1.stdout.close()
                p3 = subprocess.Popen(shlex.split("sort -u"), stdin=p2.stdout,
                                      stdout=subprocess.PIPE)
                p2.stdout.close()
                p4 = subprocess.Popen(shlex.split("wc -l"), stdin=p3.stdout,
                                      stdout=subprocess.PIPE)
                p3.stdout.close()
                assert int(p4.communicate()[0]) > 0

        @pytest.mark.ranks(2, timeout=6)
        def test_leaves_a_spinning_child(rank):
            if rank == 1:
                subprocess.Popen([sys.executable, "-c", "while True: pass", "spinning"])
        """
    )
    result = inner.runpytest("-p", "harness", "-v")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*hygiene: rank 1 left processes running (the harness killed them): pid *spinning*"]
    )
    assert "rank 0 left processes" not in result.stdout.str()
