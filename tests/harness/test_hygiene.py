"""Hygiene: what a test leaves behind in a rank is that test's error, naming the rank."""

from __future__ import annotations

import warnings

import pytest

from tests.harness.conftest import HEADER


def test_leftovers_are_errors_naming_the_rank_unless_allowed(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
import time

STOP = threading.Event()

@pytest.mark.ranks(2, launch=True)
def test_group_left(rank):
    dist.init_process_group("gloo")
    dist.barrier()  # no rank returns (and loses its group) while a peer still connects

@pytest.mark.ranks(2, timeout=10)  # a thread may run on until the test's bound
def test_thread_left(rank):
    if rank == 1:
        threading.Thread(target=STOP.wait, args=(30,), name="poller").start()

@pytest.mark.ranks(2)
def test_env_left(rank):
    os.environ["LEFT_BEHIND"] = "1"

@pytest.mark.ranks(2, launch=True)
@pytest.mark.allow_leftovers("group", "env")
def test_allowed(rank):
    dist.init_process_group("gloo")
    dist.barrier()
    os.environ["LEFT_BEHIND"] = "1"

@pytest.mark.ranks(2)
def test_next_is_clean(rank):
    assert "LEFT_BEHIND" not in os.environ
    assert [t.name for t in threading.enumerate() if t.name == "poller"] == []
"""
    )
    result = inner.runpytest("-p", "harness", "-v")
    result.assert_outcomes(passed=5, errors=3)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_group_left*",
            "*hygiene: rank 0 left the process group it set up initialised*",
            "*rank 1 left the process group*",
            "*allow_leftovers*",
            "*ERROR at teardown of test_thread_left*",
            "*hygiene: rank 1 left non-daemon threads running: poller (still running * s after "
            "the test, at its bound); join them*",
            "*ERROR at teardown of test_env_left*",
            "*hygiene: rank 0 changed environment variables LEFT_BEHIND*",
        ]
    )


def test_threads_left_behind_never_reach_a_later_test(inner: pytest.Pytester) -> None:
    """A daemon thread a test leaves (a watchdog) gets the ranks replaced: it killed its
    rank during the next test, which was blamed. A non-daemon thread that ends within a
    moment of the body, as a process's exit would wait for, is no leftover."""
    inner.makepyfile(
        HEADER
        + """
import time

WATCHDOG = threading.Event()

def _watch():
    WATCHDOG.wait()
    os._exit(17)  # the watchdog fires: the whole rank goes

@pytest.mark.ranks(2)
def test_a_starts_a_watchdog(rank):
    threading.Thread(target=_watch, name="watchdog", daemon=True).start()

@pytest.mark.ranks(2)
def test_b_would_fire_it(rank):
    WATCHDOG.set()  # on the same process as test_a's, its watchdog would kill this rank
    dist.barrier()

@pytest.mark.ranks(2)
def test_c_a_thread_ending_just_after_the_body(rank):
    threading.Thread(target=time.sleep, args=(0.3,), name="flusher").start()

@pytest.mark.ranks(2)
def test_d_leaves_an_alarm(rank):
    signal.alarm(30)  # would kill this warm rank during a later test

@pytest.mark.ranks(2)
def test_e_no_alarm_is_pending(rank):
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)

PIDS = []

@pytest.mark.ranks(2)
@pytest.mark.allow_leftovers("threads")
def test_f_a_library_thread_that_stays(rank):
    PIDS.append(os.getpid())
    threading.Thread(target=threading.Event().wait, name="library-poller", daemon=True).start()

@pytest.mark.ranks(2)
def test_g_keeps_the_ranks(rank):
    assert PIDS == [os.getpid()]
"""
    )
    with warnings.catch_warnings():
        warnings.resetwarnings()  # the inner run's own filters apply, not this suite's "error"
        result = inner.runpytest("-p", "harness", "-v")
    result.assert_outcomes(passed=7, warnings=1)
    result.stdout.fnmatch_lines(
        ["*RanksReplacedWarning: *test_a_starts_a_watchdog*left daemon threads running (watchdog)*"]
    )


def test_a_test_that_replaces_os_environ_is_reported_and_undone(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import os, pytest

        @pytest.mark.ranks(2)
        def test_a_replaces_it(rank):
            os.environ = dict(os.environ, REPLACED="1")

        @pytest.mark.ranks(2)
        def test_b_next(rank):
            assert "REPLACED" not in os.environ
            assert type(os.environ).__name__ == "_Environ"
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*hygiene: rank ? replaced os.environ itself*"])


def test_a_bad_leftover_kind_is_that_tests_error(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
@pytest.mark.ranks(2)
@pytest.mark.allow_leftovers("files")
def test_bad(rank):
    pass

def test_others_still_run():
    pass
"""
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*invalid leftover kind(s) [[]'files'[]] from the allow_leftovers marker on *test_bad*"]
    )


@pytest.mark.slow
def test_leftover_processes_at_session_end_fail_the_session(inner: pytest.Pytester) -> None:
    inner.makeconftest(
        """
        import harness.common.reaper

        real_alive = harness.common.reaper.alive
        harness.common.reaper.alive = lambda pid: True  # pretend no rank would die

        def pytest_unconfigure(config):  # after the session's end, which is checked
            harness.common.reaper.alive = real_alive
        """
    )
    inner.makepyfile(HEADER + "\n@pytest.mark.ranks(2)\ndef test_x(rank):\n    pass\n")
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(["*harness: rank processes still alive at session end: [[]*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_slow_thread_is_waited_for_until_the_tests_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A non-daemon thread the test started ends when it ends (a last flush on a saturated
    # machine took seconds): flagged after a fixed 5 s, it made a false red. Only one still
    # running at the test's own bound is left running.
    import threading
    import time

    from harness.common import hygiene

    monkeypatch.setattr(hygiene, "THREAD_END_WAIT_S", 0.01)  # the fixed wait, made short
    before = hygiene.before_test()
    slow = threading.Thread(target=threading.Event().wait, args=(0.5,), name="slow-flush")
    slow.start()
    checks = frozenset({"threads"})
    found = hygiene.findings(before, checks, False, threads_until=time.monotonic() + 60)
    assert "threads" not in found
    assert not slow.is_alive()

    stuck = threading.Event()
    never = threading.Thread(target=stuck.wait, args=(60,), name="never-ends")
    never.start()
    try:
        found = hygiene.findings(before, checks, False, threads_until=time.monotonic() + 0.2)
        assert "never-ends (still running" in found["threads"]
    finally:
        stuck.set()
        never.join()


def test_a_thread_left_running_is_found_where_it_reuses_an_ended_threads_ident() -> None:
    """A thread that ended during the test frees its ident, and the C library gives the next
    thread the same one: compared by ident, the thread the test left was taken for one that
    ran before it (rank_pool.run with a thread left: "DID NOT RAISE", now and then in CI)."""
    import threading
    import time

    from harness.common import hygiene

    ended, stop = threading.Event(), threading.Event()
    before_it = threading.Thread(target=ended.wait, name="ends during the test")
    before_it.start()
    before = hygiene.before_test()
    ended.set()
    before_it.join()
    left = threading.Thread(target=stop.wait, name="beat")
    left.start()
    try:
        found = hygiene.findings(
            before, frozenset({"threads"}), False, threads_until=time.monotonic()
        )
        assert "left non-daemon threads running: beat" in found.get("threads", "")
    finally:
        stop.set()
        left.join()
