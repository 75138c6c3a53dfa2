"""Bounded always: hangs, timeouts from every source, Ctrl-C, and no orphan processes."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.harness.conftest import (
    alive,
    assert_all_gone,
    kill_quietly,
    read_pids,
    shell_job_running_pytest,
    wait_until,
)

HANGS_ON_RANK1 = """
import os, time, pytest, torch.distributed as dist

@pytest.mark.ranks{marker_args}
def test_hang(rank):
    with open(f"pid-{{rank}}", "w") as f:  # the ranks run in the pytest process's cwd
        f.write(str(os.getpid()))
    if rank == 1:
        while True:
            time.sleep(0.05)
    dist.barrier()

@pytest.mark.ranks
def test_after(rank):
    dist.barrier()
"""


def test_a_hang_is_reported_with_stacks_and_the_session_goes_on(inner: pytest.Pytester) -> None:
    inner.makepyfile(HANGS_ON_RANK1.format(marker_args="(timeout=2)"))
    result = inner.runpytest("-p", "harness", "-v")
    result.stdout.fnmatch_lines(
        [
            "*test_hang FAILED*",
            "*test_after PASSED*",
            "rank 1 failed: hung outside any collective; rank 0 collateral*",
            "*rank 1 (pid *): hung outside any collective [[]root cause[]]*",
            "still running at the 2 s timeout; killed",
            "-- Python stacks at the deadline --",
            '*File "*test_a_hang_is_reported*.py", line * in test_hang',
            "*rank 0 (pid *): hung in barrier [[]collateral[]]*",
        ]
    )
    result.stdout.no_fnmatch_line("*harness/rank/*.py*")  # the stacks start at the test
    assert_all_gone(read_pids(inner.path))


@pytest.mark.parametrize(
    ("ini", "args", "marks"),
    [
        ("", ["--rank-timeout", "2"], ""),
        ("rank_timeout = 2", [], ""),
        ("", ["--rank-timeout", "100"], "@pytest.mark.timeout(2)"),
        ("timeout = 2", [], ""),
        ("", ["--timeout", "2"], ""),
    ],
    ids=["option", "ini", "timeout-marker", "timeout-ini", "timeout-option"],
)
@pytest.mark.slow
def test_every_timeout_source_bounds_the_ranks_with_one_timer(
    pytester: pytest.Pytester, ini: str, args: list[str], marks: str
) -> None:
    pytester.makeini(f"[pytest]\n{ini}\n")
    source = HANGS_ON_RANK1.format(marker_args="").replace(
        "@pytest.mark.ranks\ndef test_hang", f"{marks}\n@pytest.mark.ranks\ndef test_hang"
    )
    pytester.makepyfile(source)
    # The bound for a hung subprocess: generous, as a loaded CI machine needs (one took 60 s).
    result = pytester.runpytest_subprocess("-p", "harness", *args, timeout=180)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["still running at the 2 s timeout; killed"])
    # pytest-timeout's own timer never fired: its report would say "Timeout".
    result.stdout.no_fnmatch_line("*+++ Timeout +++*")


@pytest.mark.slow
def test_pytest_timeout_still_bounds_a_rank_tests_set_up_and_teardown(
    pytester: pytest.Pytester,
) -> None:
    """The harness's timer bounds the body; pytest-timeout's bounds the fixtures around it,
    made in the pytest process, as in a plain test."""
    pytester.makepyfile(
        """
        import threading, pytest

        @pytest.fixture
        def stuck_set_up():
            threading.Event().wait()

        @pytest.fixture
        def stuck_teardown():
            yield
            threading.Event().wait()

        @pytest.mark.ranks(2)
        def test_set_up(rank, stuck_set_up):
            pass

        @pytest.mark.ranks(2)
        def test_teardown(rank, stuck_teardown):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "harness", "--timeout", "3", timeout=120)
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(["*Timeout (>3.0s)*"])


def test_a_timeout_marker_of_0_turns_pytest_timeout_off_as_for_a_plain_test(
    inner: pytest.Pytester,
) -> None:
    # pytest-timeout reads 0 as "no timeout"; the harness's own bound still holds.
    inner.makepyfile(
        """
        import threading, pytest

        @pytest.mark.timeout(0)
        @pytest.mark.ranks(2)
        def test_unbounded_by_pytest_timeout(rank):
            pass

        @pytest.mark.timeout(0)
        @pytest.mark.ranks(2)
        def test_still_bounded_by_the_harness(rank):
            if rank == 1:
                threading.Event().wait()
        """
    )
    result = inner.runpytest("-p", "harness", "--timeout", "5", "--rank-timeout", "2")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*still running at the 2 s timeout; killed*"])


def test_bad_option_values_name_their_source(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("-p", "harness", "--rank-timeout", "soon")
    result.stderr.fnmatch_lines(["*invalid timeout 'soon' from --rank-timeout*seconds > 0*"])
    pytester.makeini("[pytest]\nrank_start_method = teleport\n")
    result = pytester.runpytest("-p", "harness")
    result.stderr.fnmatch_lines(
        [
            "*invalid start method 'teleport' from ini option 'rank_start_method': "
            "choose one of forkserver, spawn, fork"
        ]
    )


def test_ini_options_set_the_world(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nranks = 3\nrank_backend = gloo\nrank_start_method = forkserver\n")
    pytester.makepyfile(
        """
        import pytest, torch.distributed as dist

        @pytest.mark.ranks
        def test_three(world_size):
            assert world_size == 3 == dist.get_world_size()
        """
    )
    pytester.runpytest("-p", "harness").assert_outcomes(passed=1)


@pytest.mark.slow
def test_ctrl_c_leaves_no_rank_behind(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(HANGS_ON_RANK1.format(marker_args="(timeout=120)"))
    proc = subprocess.Popen(
        shell_job_running_pytest("-p", "harness", "-x", str(pytester.path)),
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: len(read_pids(pytester.path)) == 2, 60, "both ranks to start")
        pids = read_pids(pytester.path)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert b"KeyboardInterrupt" in out, out.decode()[-2000:]
        assert_all_gone(pids)
    finally:
        proc.kill()
        kill_quietly(read_pids(pytester.path))


@pytest.mark.slow
def test_a_killed_pytest_takes_its_ranks_with_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(HANGS_ON_RANK1.format(marker_args="(timeout=120)"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "harness", str(pytester.path)],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: len(read_pids(pytester.path)) == 2, 60, "both ranks to start")
        pids = read_pids(pytester.path)
        proc.kill()  # no cleanup code runs: only PDEATHSIG can end the ranks
        proc.wait(timeout=30)
        assert_all_gone(pids)
    finally:
        kill_quietly(read_pids(pytester.path))


@pytest.mark.slow
def test_a_finished_session_leaves_no_process(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os, pytest

        @pytest.mark.ranks(2, 4)
        def test_pid(rank, world_size):
            with open(f"pid-{world_size}-{rank}", "w") as f:
                f.write(str(os.getpid()))
        """
    )
    result = pytester.runpytest_subprocess("-p", "harness")
    result.assert_outcomes(passed=2)
    pids = read_pids(pytester.path)
    assert len(pids) == 6
    assert not [p for p in pids if alive(p)]


@pytest.mark.slow
def test_xdist_workers_each_own_their_pools(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(2, 3)
        @pytest.mark.parametrize("i", range(4))
        def test_sum(i, world_size):
            t = torch.tensor([float(i)])
            dist.all_reduce(t)
            assert t.item() == i * world_size
        """
    )
    result = pytester.runpytest_subprocess("-p", "harness", "-n", "2")
    result.assert_outcomes(passed=8)


def test_markers_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("-p", "harness", "--markers")
    result.stdout.fnmatch_lines(
        ["@pytest.mark.ranks(*sizes, timeout=None, launch=False*", "@pytest.mark.gpu*"]
    )


def test_nccl_without_gpus_is_skipped_with_the_reason(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    # This machine has no GPU, whatever machine runs the suite (a GPU runner has some).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2, backend="nccl")
        def test_gpu(rank):
            pass
        """
    )
    result = inner.runpytest("-p", "harness", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs 2 CUDA GPU(s), this machine has 0*"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_other_start_methods(pytester: pytest.Pytester, method: str) -> None:
    pytester.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks
        def test_sum(world_size):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == world_size
        """
    )
    result = pytester.runpytest_subprocess("-p", "harness", "--rank-start-method", method)
    result.assert_outcomes(passed=1)


# ---- a pool's start: bounded on time without progress, not on time ---------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_start_that_uses_cpu_is_given_more_time_up_to_the_cap() -> None:
    from harness.warm import start_watch

    clock, used = _Clock(), {7: 0.0}
    watch = start_watch.StartWatch(clock, lambda pid: (used[pid], "R"))
    for _ in range(5):  # a busy runner: 100 s apart, a little CPU each time
        clock.now += 100.0
        used[7] += 0.5
        assert not watch.expired([7])
    clock.now = start_watch.START_CAP_S
    used[7] += 0.5
    assert watch.expired([7])
    assert "still starting after 600 s" in watch.account(7)
    assert "pid 7, running, 3.00 s of CPU" in watch.account(7)


def test_a_start_without_progress_is_cut_at_the_bound() -> None:
    from harness.warm import start_watch

    clock = _Clock()
    watch = start_watch.StartWatch(clock, lambda pid: (0.25, "S"))
    clock.now = 1.0
    assert not watch.expired([7, 8])  # their first CPU seen: progress
    clock.now = start_watch.NO_PROGRESS_S
    assert not watch.expired([7, 8])
    clock.now = 1.0 + start_watch.NO_PROGRESS_S
    assert watch.expired([7, 8])
    assert "no progress for 120 s (pid 8, sleeping, 0.25 s of CPU; 121 s" in (watch.account(8))


# A rank's start replaced (fork: the ranks are forks of the pytest process, which the
# conftest patched): stuck on a lock, or busy past the no-progress bound and then ready.
START_CONFTEST = """
import threading, time
from harness.rank import worker
from harness.warm import start_watch

start_watch.NO_PROGRESS_S = 3.0
start_watch.CHECK_S = 0.1
bootstrap = worker._bootstrap

def stuck(files):
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # held, and no one will release it: the rank sleeps

def busy(files):
    end = time.process_time() + 2 * start_watch.NO_PROGRESS_S
    while time.process_time() < end:
        pass
    return bootstrap(files)

worker._bootstrap = {start}
"""


@pytest.mark.slow
@pytest.mark.parametrize("start", ["stuck", "busy"])
def test_a_stuck_rank_start_is_cut_and_a_busy_one_is_waited_for(
    pytester: pytest.Pytester, start: str
) -> None:
    pytester.makeconftest(START_CONFTEST.format(start=start))
    pytester.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_sum():
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """
    )
    result = pytester.runpytest_subprocess("-p", "harness", "--rank-start-method", "fork")
    if start == "busy":
        result.assert_outcomes(passed=1)
        return
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 0 did not start (fork): no progress for 3 s (pid *, sleeping, *",
            "*py-spy dump --pid *",
        ]
    )


# ---- the harness's own set-up of a rank ------------------------------------------------------

SETUP_FAILURES = "_HARNESS_TEST_SETUP_FAILURES"  # the first N set-ups fail on rank 1 (tests only)


def test_a_failed_rank_set_up_is_retried_within_the_bound(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SETUP_FAILURES, "1")
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(3)
        def test_body_runs_once_on_a_good_group(rank, shared_tmp_path):
            (shared_tmp_path / f"ran-{rank}").touch(exist_ok=False)  # a second run would fail
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 3
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_a_set_up_that_keeps_failing_is_a_harness_error_not_the_tests(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SETUP_FAILURES, "99")
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(3)
        def test_never_starts(rank):
            raise AssertionError("the body must not run")

        @pytest.mark.ranks(3)
        @pytest.mark.parametrize("n", [1])
        def test_next(rank, n):
            pass
        """
    )
    result = inner.runpytest("-p", "harness", "-k", "never_starts")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*harness error: the ranks could not be set up for this test (3 attempts)*",
            "*rank 1: RuntimeError: simulated set-up failure*",
        ]
    )
    result.stdout.no_fnmatch_line("*root cause*")
    result.stdout.no_fnmatch_line("*the body must not run*")
    monkeypatch.delenv(SETUP_FAILURES)
    inner.runpytest("-p", "harness", "-k", "next").assert_outcomes(passed=1)


SLOW_TO_IMPORT = """
import os, threading, pytest

if os.environ.get("HARNESS_RANK_WORKER"):  # in the ranks: an import as slow as a big library's
    threading.Event().wait(float(os.environ.get("SLOW_IMPORT_S", "3")))


@pytest.mark.ranks(2, timeout=2)
def test_quick_body(rank):
    pass


@pytest.mark.ranks(2, timeout=2)
def test_quick_body_again(rank):
    pass
"""


def test_importing_the_test_module_is_not_counted_in_the_tests_bound(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank imports the test module on its first test, and that counted in the test's
    timeout: four ranks importing transformers at once were "hung outside any collective"
    at 30 s, with some 90 importlib frames each. Loading the module is a phase of its own."""
    inner.makepyfile(test_slow_import=SLOW_TO_IMPORT)
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


SLOW_TO_IMPORT_FOR_SPAWN = """
import os, threading
import harness

if os.environ.get("HARNESS_RANK_WORKER"):  # in the ranks: an import as slow as a big library's
    threading.Event().wait(float(os.environ.get("SLOW_IMPORT_S", "3")))


def work(rank, *args):
    return rank
"""


def test_a_spawned_or_pooled_functions_module_is_imported_outside_the_runs_bound(
    inner: pytest.Pytester,
) -> None:
    """harness.spawn, RankPool and rank_pool import the function's module on the ranks in a
    phase of its own (--rank-import-timeout), as a ranks test's module is: under load the
    ranks still imported torch's test utilities at the run's 15 s bound, a false red."""
    inner.makepyfile(
        slow_helpers=SLOW_TO_IMPORT_FOR_SPAWN,
        test_runs="""
        import harness
        import slow_helpers

        def test_spawn():
            harness.spawn(slow_helpers.work, nprocs=2, timeout=2)

        def test_pool(pytestconfig):
            pool = harness.RankPool(pytestconfig, world_size=2, timeout=2)
            assert pool.run(slow_helpers.work) == [0, 1]

        def test_fixture(rank_pool):
            assert rank_pool.run(slow_helpers.work) == [0, 1]
        """,
    )
    inner.runpytest("-p", "harness", "--ranks", "2").assert_outcomes(passed=3)


def test_a_spawned_functions_module_that_cannot_be_imported_fails_the_run_saying_so(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOW_IMPORT_S", "60")
    inner.makepyfile(
        slow_helpers=SLOW_TO_IMPORT_FOR_SPAWN,
        test_runs="""
        import harness
        import slow_helpers

        def test_spawn():
            harness.spawn(slow_helpers.work, nprocs=2)
        """,
    )
    result = inner.runpytest("-p", "harness", "--rank-import-timeout", "1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*rank ? still importing slow_helpers after 1 s (--rank-import-timeout)*"]
    )


PRINTS_WHILE_IMPORTED = """
import os, sys, warnings, pytest

if os.environ.get("HARNESS_RANK_WORKER"):  # in the ranks: a library's load warnings
    print("LOADED IN A RANK", flush=True)
    print("A LOAD WARNING", file=sys.stderr, flush=True)
    warnings.warn("A WARNING ISSUED WHILE LOADING", UserWarning)


@pytest.mark.ranks(2)
def test_first(rank):
    pass


@pytest.mark.ranks(2)
def test_second(rank):
    pass
"""


def test_what_the_ranks_print_importing_the_test_module_is_on_the_first_test(
    inner: pytest.Pytester,
) -> None:
    """Since the import is a phase of its own, what the ranks printed while importing the
    test module (a library's load warnings) was in no report: the phase kept it only when
    the import failed."""
    inner.makepyfile(test_prints=PRINTS_WHILE_IMPORTED)
    result = inner.runpytest("-p", "harness", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_first?ranks2? _*",
            "*Captured stdout [[]rank 0[]] importing test_prints*",
            "LOADED IN A RANK",
            "*Captured stderr [[]rank 1[]] importing test_prints*",
            "A LOAD WARNING",
        ]
    )
    assert result.stdout.str().count("LOADED IN A RANK") == 2, result.stdout.str()  # once each
    result.stdout.fnmatch_lines(
        ["*warnings summary*", "*UserWarning: ?ranks 0, 1? A WARNING ISSUED WHILE LOADING"]
    )


def test_an_import_past_its_own_bound_is_reported_as_what_it_is(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOW_IMPORT_S", "60")
    inner.makepyfile(test_slow_import=SLOW_TO_IMPORT)
    result = inner.runpytest("-p", "harness", "--rank-import-timeout", "1")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        ["*rank ? still importing test_slow_import after 1 s (--rank-import-timeout)*"]
    )
    result.stdout.no_fnmatch_line("*still running at the 1 s timeout*")  # not the test's bound
    assert "<frozen importlib._bootstrap>" not in result.stdout.str()  # folded
    result.stdout.no_fnmatch_line("*harness/rank/*.py*")  # the stack starts at the import


def test_a_module_that_fails_to_import_in_the_ranks_shows_its_own_frames(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        test_broken_in_ranks="""
        import os
        import pytest

        if os.environ.get("HARNESS_RANK_WORKER") == "1":
            raise ImportError("only the ranks cannot import this")

        @pytest.mark.ranks(2)
        def test_a(rank):
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ImportError: only the ranks cannot import this*"])
    result.stdout.no_fnmatch_line("*harness/rank/*.py*")
