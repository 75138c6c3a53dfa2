"""Verdicts that are true in every corner: no false green, the real root cause, clear reports.

Each test here failed before its fix (issue 13 lists the cases).
"""

from __future__ import annotations

import os
import warnings

import pytest

# ---- false greens ---------------------------------------------------------------------------


def test_an_async_test_fails_as_plain_pytest_fails_it(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        async def test_coroutine(rank):
            assert False, "never awaited, never run"

        async def test_plain_coroutine():
            assert False, "never awaited, never run"
        """
    )
    result = inner.runpytest_subprocess("-p", "harness", "-rs")
    # pytest 8.4 and later fail such a test; before, it warned and skipped it: alike here.
    plain_fails = tuple(int(n) for n in pytest.__version__.split(".")[:2]) >= (8, 4)
    result.assert_outcomes(**({"failed": 2} if plain_fails else {"skipped": 2, "warnings": 1}))
    result.stdout.fnmatch_lines(["*async def functions are not natively supported*"] * 2)


def test_a_fault_whose_point_is_never_reached_fails_the_test(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from harness import fault_point

        @pytest.mark.ranks(2)
        @pytest.mark.fault(rank=1, kind="raise", at="load_bach")
        def test_typo(rank):
            fault_point("load_batch")

        @pytest.mark.ranks(2)
        @pytest.mark.fault(rank=1, kind="delay", seconds=0, at="step", nth=3)
        def test_too_few_passes(rank):
            for _ in range(2):
                fault_point("step")
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "rank 1 failed: raised FaultNotReached: fault raise at 'load_bach' was never "
            "reached on rank 1*",
            "*points passed on rank 1: 'load_batch' (1), 'start' (1)*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*fault delay at 'step' (pass 3) was never reached on rank 1*'step' (2)*"]
    )


def test_an_xfail_does_not_hide_a_fault_that_never_fired(inner: pytest.Pytester) -> None:
    """The test itself is wrong (the fault's point is misspelt): no xfail can expect that."""
    inner.makepyfile(
        """
        import pytest, harness
        from harness import fault_point

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(reason="the loader fails")
        @pytest.mark.fault(rank=1, kind="raise", exc=OSError("disk"), at="laod")
        def test_misspelt(rank):
            fault_point("load")

        def load():
            fault_point("load")

        @pytest.mark.xfail(reason="the loader fails")
        def test_misspelt_from_outside(run_on_ranks):
            fault = harness.Fault(rank=1, kind="raise", exc=OSError("disk"), at="laod")
            run_on_ranks(load, world_size=2, faults=[fault]).values
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*FaultNotReached: fault raise at 'laod' was never reached*"])


# ---- the real root cause --------------------------------------------------------------------


def test_a_ranks_own_port_clash_is_its_failure_not_a_lost_peer(inner: pytest.Pytester) -> None:
    """torch raises DistNetworkError for a port already taken, which reads like a peer's
    failure; the rank that could not bind is the root cause."""
    inner.makepyfile(
        """
        import socket, pytest, torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_bind(rank):
            if rank == 0:
                held = socket.create_server(("127.0.0.1", 0))
                port = held.getsockname()[1]
                dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["rank 0 failed: raised DistNetworkError*"])
    result.stdout.fnmatch_lines(["*rank 0 (pid *): raised DistNetworkError*[[]root cause[]]*"])


ORIGIN = """
import time, pytest, torch
import rankwise as rw
from harness import assert_on_all_ranks

def slow_to_report(exc_type):
    # Rank 2 is the origin, but the last to report: the race that named the wrong rank.
    try:
        yield
    except exc_type:
        time.sleep(0.5)
        raise

@pytest.mark.ranks(4)
def test_all_reduce(rank):
    def value():
        if rank == 2:
            raise ValueError("bad batch on 2")
        return rank
    with contextlib.contextmanager(slow_to_report)(ValueError):
        rw.all_reduce("batch_size", value, sum)

@pytest.mark.ranks(4)
def test_assert_on_all_ranks(rank):
    with contextlib.contextmanager(slow_to_report)(AssertionError):
        assert_on_all_ranks(rank != 2, "loss is nan")
"""


def test_the_origin_of_an_error_every_rank_raises_is_the_root_cause(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile("import contextlib\n" + ORIGIN)
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "rank 2 failed: raised ValueError: bad batch on 2; ranks 0, 1, 3 collateral*",
            "rank 2 failed: raised AssertionError: condition false on rank(s) [[]2[]]*; "
            "ranks 0, 1, 3 collateral*",
        ]
    )


def test_a_fault_at_a_label_acts_as_that_ranks_fn_raising(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        import rankwise as rw
        from harness import raises

        OTHERS = r"all_reduce\\('batch_size'\\): rank 3 raised MemoryError"

        @pytest.mark.ranks(4)
        @pytest.mark.fault(rank=3, kind="raise", exc=MemoryError, at="batch_size")
        @pytest.mark.expect(
            rank=3, does=raises(MemoryError), others=raises(RuntimeError, match=OTHERS)
        )
        def test_fault_in_collective(rank):
            rw.all_reduce("batch_size", lambda: rank, sum)

        @pytest.mark.ranks(3)
        @pytest.mark.fault(rank=0, kind="raise", exc=KeyError, at="broadcast_from:config")
        @pytest.mark.expect(
            rank=0, does=raises(KeyError), others=raises(RuntimeError, match="src rank 0 raised")
        )
        def test_fault_at_the_source(rank):
            rw.broadcast_from("config", lambda: {"lr": 1.0}, src=0)
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_a_rank_that_returns_while_peers_wait_is_named(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(4)
        def test_leaves_early(rank):
            if rank == 3:
                return  # forgot the all_reduce: its group is torn down under the peers
            t = torch.ones(1)
            dist.all_reduce(t)
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "rank 3 returned while ranks 0, 1, 2 waited in all_reduce*",
            "*rank 3 (pid *): returned [[]root cause[]]*",
            "rank 0 (pid *), waiting in all_reduce: *",
        ]
    )


def test_a_rank_alone_in_a_collective_every_other_rank_returned_from_is_named(
    inner: pytest.Pytester,
) -> None:
    """The other side of the case above: rank 2 called all_reduce and no other rank did. It
    is the root cause, with its traceback, not the first rank that returned."""
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(4)
        def test_calls_alone(rank):
            if rank == 2:
                dist.all_reduce(torch.ones(1))  # no other rank calls it
        """
    )
    result = inner.runpytest("-p", "harness", "--rank-timeout", "30")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "rank 2 waited in all_reduce while ranks 0, 1, 3 returned*",
            "*rank 2 (pid *): * [[]root cause[]]*",
            "*dist.all_reduce(torch.ones(1))*",
        ]
    )
    result.stdout.no_fnmatch_line("*returned [[]root cause[]]*")


def test_a_ranks_own_network_error_is_its_failure_not_a_peers(inner: pytest.Pytester) -> None:
    """Text like "Connection refused" reads as a peer gone only from torch.distributed."""
    inner.makepyfile(
        """
        import socket, pytest

        @pytest.mark.ranks(2)
        def test_connects(rank):
            if rank == 0:
                with socket.socket() as s:  # a port nobody listens on
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                socket.create_connection(("127.0.0.1", port), timeout=5)

        @pytest.mark.ranks(2)
        def test_pipe(rank):
            if rank == 1:
                raise BrokenPipeError("Broken pipe: the service's own pipe closed")
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "rank 0 failed: raised ConnectionRefusedError: *",
            "rank 1 failed: raised BrokenPipeError: Broken pipe: the service's own pipe closed*",
        ],
        consecutive=False,
    )


def test_a_rank_hung_in_a_collectives_fn_is_the_root_cause(inner: pytest.Pytester) -> None:
    """Every rank is inside all_reduce('batch'); only rank 2 never reached the exchange."""
    inner.makepyfile(
        """
        import threading, pytest
        import rankwise as rw

        def measure(rank):
            if rank == 2:
                threading.Event().wait()  # rank 2's own code never returns
            return 1

        @pytest.mark.ranks(3, timeout=3)
        def test_fn_hangs(rank):
            rw.all_reduce("batch", lambda: measure(rank), sum)

        @pytest.mark.ranks(3, timeout=3)
        @pytest.mark.fault(rank=2, kind="hang", at="batch")
        def test_injected_hang(rank):
            rw.all_reduce("batch", lambda: 1, sum)
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        ["rank 2 failed: hung in all_reduce('batch'), before its exchange; ranks 0, 1 collateral*"]
        * 2,
        consecutive=False,
    )


def test_a_peers_timeout_waiting_for_a_late_rank_is_collateral(inner: pytest.Pytester) -> None:
    """Ranks 0 and 1 time out in a collective waiting for rank 2, which then fails itself."""
    inner.makepyfile(
        """
        import time
        from datetime import timedelta
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(3)
        def test_late_rank(rank, shared_tmp_path):
            group = dist.new_group(timeout=timedelta(seconds=1))
            if rank < 2:
                try:
                    dist.all_reduce(torch.ones(1), group=group)
                finally:
                    (shared_tmp_path / f"timed-out-{rank}").touch()
            deadline = time.monotonic() + 30
            while len(list(shared_tmp_path.glob("timed-out-*"))) < 2:  # rank 2 comes late
                assert time.monotonic() < deadline
                time.sleep(0.01)
            raise ValueError("rank 2 could not load its shard")
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["rank 2 failed: raised ValueError: rank 2 could not load its shard; ranks 0, 1 coll*"]
    )


def test_ranks_out_of_step_in_a_hang_are_named_with_where_each_is(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(3, timeout=3)
        def test_out_of_step(rank):
            t = torch.ones(1)
            if rank == 0:
                dist.broadcast(t, src=0)
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
                dist.all_reduce(t)
        """
    )
    # Without the collective check (with it, rank 0 is named: test_a_mismatched_...).
    result = inner.runpytest("-p", "harness", "--rank-no-collective-check")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "ranks out of step: rank 0 in broadcast; ranks 1, 2 in all_reduce*",
            "*rank 0 (pid *): hung in broadcast [[]out of step[]]*",
        ]
    )
    result.stdout.no_fnmatch_line("*root cause*")
    checked = inner.runpytest("-p", "harness")
    checked.assert_outcomes(failed=1)
    checked.stdout.fnmatch_lines(
        ["rank 0 failed: raised CollectiveMismatch: called broadcast on a tensor of shape *"]
    )


# ---- clearer reports ------------------------------------------------------------------------


def test_sys_exit_shows_where_it_was_called(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_exit_where="""
        import sys, pytest

        def give_up():
            sys.exit(3)

        @pytest.mark.ranks(2)
        def test_exits(rank):
            if rank == 1:
                give_up()
        """
    )
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(
        [
            "*rank 1 (pid *): called sys.exit(3) [[]root cause[]]*",
            "Traceback (most recent call last):",
            '*test_exit_where.py", line *, in test_exits',
            "*give_up()",
            '*test_exit_where.py", line *, in give_up',
            "*sys.exit(3)",
            "SystemExit: 3",
        ]
    )
    result.stdout.no_fnmatch_line("*harness/rank/*.py*")  # the stacks start at the test


def test_hang_stacks_show_each_frames_source_line(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_hang_source="""
        import threading, pytest

        @pytest.mark.ranks(2, timeout=2)
        def test_hang(rank):
            threading.Event().wait()  # stuck here
        """
    )
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(
        [
            '*File "*test_hang_source.py", line 5 in test_hang',
            "    threading.Event().wait()  # stuck here",
        ]
    )


def test_a_skip_in_ranks_is_reported_where_it_was_called(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_skip_where="""
        import pytest

        @pytest.mark.ranks(2)
        def test_skipped(rank):
            pytest.skip("not today")
        """
    )
    result = inner.runpytest("-p", "harness", "-rs")
    result.assert_outcomes(skipped=1)
    # As pytest reports a plain test's skip: the line that called it, not a harness file's.
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_skip_where.py:5: not today"])


# ---- a later test never pays for an earlier one ----------------------------------------------

BREAKS_THEN_CHECKS = {
    "streams": (
        "sys.stdout.close(); sys.stderr.close()",
        "print('out ok'); print('err ok', file=sys.stderr)",
    ),
    "replaced-streams": ("sys.stdout = io.StringIO()", "assert sys.stdout.fileno() == 1"),
    "fds": (
        "os.close(0); os.close(1); os.close(2)",
        "assert stat.S_ISREG(os.fstat(1).st_mode) and stat.S_ISREG(os.fstat(2).st_mode); "
        "os.fstat(0); os.write(1, b'fd 1 reaches the report\\n')",
    ),
    "cwd": ("os.chdir('/')", "assert os.getcwd() == START_CWD"),
    "sys.path": ("sys.path[:] = ['/nowhere']", "import json; assert '/nowhere' not in sys.path"),
    "signal": (
        "signal.signal(signal.SIGTERM, lambda *a: None)",
        "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL",
    ),
    "dtype": (
        "torch.set_default_dtype(torch.float64)",
        "assert torch.ones(1).dtype == torch.float32",
    ),
    "threads": ("torch.set_num_threads(7)", "assert torch.get_num_threads() == START_THREADS"),
    "grad-mode": ("torch.set_grad_enabled(False)", "assert torch.is_grad_enabled()"),
    "deterministic": (
        "torch.use_deterministic_algorithms(True, warn_only=True)",
        "assert not torch.are_deterministic_algorithms_enabled()",
    ),
    # Found by an adversarial pass over adopted suites: each failed the next test.
    "default-device": (
        "torch.set_default_device('meta')",
        "assert torch.ones(1).device.type == 'cpu'",
    ),
    "print-options": (
        "torch.set_printoptions(precision=1, linewidth=20)",
        "assert str(torch.tensor([0.12345])) == 'tensor([0.1235])'",
    ),
    "anomaly-mode": (
        "torch.autograd.set_detect_anomaly(True, check_nan=False)",
        "assert not torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()",
    ),
    "matmul-precision": (
        "torch.set_float32_matmul_precision('medium')",
        "assert torch.get_float32_matmul_precision() == 'highest'",
    ),
    "matmul-precision-per-backend": (
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'; "
        "torch.backends.mkldnn.matmul.fp32_precision = 'bf16'",
        "assert torch.backends.cuda.matmul.fp32_precision == 'none'; "
        "assert torch.get_float32_matmul_precision() == 'highest'",
    ),
    "cudnn-enabled": (
        "torch.backends.cudnn.enabled = False; torch.backends.cudnn.allow_tf32 = False",
        "assert torch.backends.cudnn.enabled and torch.backends.cudnn.allow_tf32",
    ),
    "cudnn-flags": (
        "torch.backends.cudnn.benchmark = True; torch.backends.cudnn.deterministic = True",
        "assert not torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic",
    ),
}


RANK_FILE_CLOSER = """
import os
from harness.rank import state

def close_descriptors_of(fd_file, keep):
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep:
            continue
        try:
            found = os.fstat(fd)
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (fd_file.st_dev, fd_file.st_ino):
            os.close(fd)

def close_other_descriptors_of(fd_file):
    # every descriptor of that file but fds 0-2 and the copies the rank restores them from
    close_descriptors_of(fd_file, {0, 1, 2, *state.fd_copies()})
"""


def test_a_test_that_leaves_its_rank_beyond_repair_errors_and_the_next_gets_new_ranks(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        RANK_FILE_CLOSER
        + """
import pytest

@pytest.mark.ranks(2)
def test_a_closes_the_ranks_copy_of_stdin(rank):
    close_descriptors_of(os.fstat(0), keep={0, 1, 2})  # what fd 0 is restored from

@pytest.mark.ranks(2)
def test_b_next(rank):
    pass
"""
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_a_closes*",
            "*rank ? changed its process in a way the harness could not undo (OSError*",
        ]
    )
    assert "allow_leftovers" not in result.stdout.str()


def test_a_test_that_closes_the_ranks_output_files_does_not_break_the_next(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        RANK_FILE_CLOSER
        + """
import pytest

@pytest.mark.ranks(2)
def test_a_closes_them(rank):
    print("before")
    close_other_descriptors_of(os.fstat(1))
    close_other_descriptors_of(os.fstat(2))

@pytest.mark.ranks(2)
def test_b_next(rank):
    print(f"rank {rank} in b")
    assert False, "shows its output"
"""
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 0*raised AssertionError: shows its output*"])
    result.stdout.fnmatch_lines(["rank 1 in b"])
    assert "before" not in result.stdout.str()  # each test's output is its own


TAKES_THE_STACKS = {
    "closes-the-file": """
    stacks = [p for p in glob.glob(os.path.dirname(os.readlink("/proc/self/fd/1")) + "/*")
              if p.endswith(f"rank{rank}.stacks")]
    close_other_descriptors_of(os.stat(stacks[0]))
""",
    "takes-the-signal": """
    signal.signal(signal.SIGUSR1, lambda *args: None)
""",
}


@pytest.mark.parametrize("how", list(TAKES_THE_STACKS))
def test_a_test_that_takes_the_ranks_stack_dump_still_leaves_hang_stacks_later(
    inner: pytest.Pytester, how: str
) -> None:
    inner.makepyfile(
        RANK_FILE_CLOSER
        + """
import glob, signal, time, pytest

@pytest.mark.ranks(2)
def test_a_takes_it(rank):"""
        + TAKES_THE_STACKS[how]
        + """

@pytest.mark.ranks(2, timeout=2)
def test_b_hangs(rank):
    if rank == 1:
        time.sleep(60)
"""
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*Python stacks at the deadline*", "*time.sleep(60)*"])


@pytest.mark.parametrize("what", list(BREAKS_THEN_CHECKS))
def test_a_warm_rank_is_restored_for_the_next_test(inner: pytest.Pytester, what: str) -> None:
    breaks, checks = BREAKS_THEN_CHECKS[what]
    inner.makepyfile(
        f"""
        import io, os, signal, stat, sys, pytest, torch

        START_CWD = os.getcwd()
        START_THREADS = torch.get_num_threads()

        @pytest.mark.ranks(2)
        @pytest.mark.allow_leftovers()
        def test_a_breaks(rank):
            {breaks}

        @pytest.mark.ranks(2)
        def test_b_is_clean(rank):
            {checks}
        """
    )
    result = inner.runpytest("-p", "harness", "-v", "-rP")
    result.stdout.fnmatch_lines(["*test_a_breaks* PASSED*", "*test_b_is_clean* PASSED*"])
    result.assert_outcomes(passed=2)  # and no error at test_a's teardown: it was undone
    if what == "fds":  # what the next test writes to fd 1 is captured, not lost
        result.stdout.fnmatch_lines(["*Captured stdout [[]rank 0[]] call*", "fd 1 reaches*"])


# ---- pytest's warning filters apply inside ranks ---------------------------------------------

WARNS_ON_RANK1 = """
import warnings, pytest

@pytest.mark.ranks(2)
{marks}
def test_warns(rank):
    if rank == 1:
        warnings.warn("careful", UserWarning)
"""


@pytest.mark.parametrize(
    ("ini", "args", "marks"),
    [
        ("", ["-W", "error::UserWarning"], ""),
        ("filterwarnings = error", [], ""),
        ("", [], "@pytest.mark.filterwarnings('error::UserWarning')"),
    ],
    ids=["command-line", "ini", "marker"],
)
def test_a_warning_filtered_to_error_fails_the_rank(
    inner: pytest.Pytester, ini: str, args: list[str], marks: str
) -> None:
    inner.makeini(f"[pytest]\nrank_timeout = 30\n{ini}\n")
    inner.makepyfile(WARNS_ON_RANK1.format(marks=marks))
    result = inner.runpytest("-p", "harness", *args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["rank 1 failed: raised UserWarning: careful*"])


def test_a_marker_can_ignore_what_the_ini_makes_an_error(inner: pytest.Pytester) -> None:
    inner.makeini("[pytest]\nrank_timeout = 30\nfilterwarnings = error\n")
    inner.makepyfile(
        WARNS_ON_RANK1.format(marks="@pytest.mark.filterwarnings('ignore:careful:UserWarning')")
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_rank_warnings_appear_in_the_summary_naming_the_rank(inner: pytest.Pytester) -> None:
    inner.makepyfile(WARNS_ON_RANK1.format(marks=""))
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*warnings summary*", "*UserWarning: [[]rank 1[]] careful*"])


@pytest.mark.gpu
def test_the_cuda_device_is_restored_for_the_next_test(inner: pytest.Pytester) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    inner.makepyfile(
        """
        import pytest, torch

        @pytest.mark.ranks(1)
        def test_a_moves(rank):
            torch.cuda.set_device(1)

        @pytest.mark.ranks(1)
        def test_b_starts_on_device_0(rank):
            assert torch.cuda.current_device() == 0
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


PYTESTS_OWN_WARNINGS = """
import gc, threading, pytest

class Noisy:
    def __del__(self):
        raise ValueError("in __del__")

@pytest.mark.ranks(2)
def test_thread_raises(rank):
    if rank == 1:
        worker = threading.Thread(target=lambda: 1 / 0, name="loader")
        worker.start()
        worker.join()

@pytest.mark.ranks(2)
def test_unraisable(rank):
    if rank == 1:
        Noisy()
        gc.collect()

@pytest.mark.ranks(2)
def test_returns_a_value(rank):
    return rank
"""


def test_pytests_own_warnings_come_from_ranks_too(inner: pytest.Pytester) -> None:
    """An exception in a rank's thread, an unraisable one and a test returning a value warn
    as in a plain test: in the summary, and as failures under -W error."""
    inner.makepyfile(PYTESTS_OWN_WARNINGS)
    with warnings.catch_warnings():  # the inner run in this process: without our "error"
        warnings.resetwarnings()
        result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "*PytestUnhandledThreadExceptionWarning: [[]rank 1[]] *loader*",
            "*PytestUnraisableExceptionWarning: [[]rank 1[]] *Noisy.__del__*",
            "*PytestReturnNotNoneWarning: *test_returns_a_value*returned*",
        ],
        consecutive=False,
    )
    strict = inner.runpytest("-p", "harness", "-W", "error::pytest.PytestWarning")
    strict.assert_outcomes(failed=3)
    strict.stdout.fnmatch_lines(
        ["*rank 1 failed: raised PytestUnhandledThreadExceptionWarning*"], consecutive=False
    )


def test_a_ranks_tests_return_value_travels_as_its_repr_only(inner: pytest.Pytester) -> None:
    """The pytest process needs only a ranks test's return value's repr (for its warning):
    every rank pickled the whole value and sent it (a 256 MB tensor on 2 ranks grew pytest by
    767 MB). A run_on_ranks call's values still travel whole."""
    inner.makepyfile(
        """
        import os, warnings
        import pytest

        class Counted:
            def __repr__(self):
                return "Counted()"

            def __reduce__(self):  # a pickle of it leaves a file behind, in the rank
                open(os.path.join(os.environ["WHERE"], f"pickled{os.getpid()}"), "w").close()
                return (Counted, ())

        def value():
            return Counted()

        @pytest.mark.ranks(2)
        def test_returns(rank):
            return Counted()

        def test_calls(run_on_ranks, tmp_path):
            assert [repr(v) for v in run_on_ranks(value, world_size=2).values] == ["Counted()"] * 2
        """
    )
    where = inner.path / "pickles"
    where.mkdir()
    os.environ["WHERE"] = str(where)  # the ranks get this process's (inner puts it back)
    with warnings.catch_warnings():
        warnings.resetwarnings()
        result = inner.runpytest("-p", "harness", "-k", "test_returns")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_returns*returned Counted() on ranks 0, 1*"])
    assert list(where.iterdir()) == []
    calls = inner.runpytest("-p", "harness", "-k", "test_calls")
    calls.assert_outcomes(passed=1)
    assert len(list(where.iterdir())) == 2  # the call's values did travel


def test_an_exception_in_del_as_a_ranks_test_lets_its_values_go_is_reported(
    inner: pytest.Pytester,
) -> None:
    """A value the test's fixtures gave it whose __del__ raises when the test lets it go was
    lost in a rank (2 passed, nothing on any stream, under -W error): the rank freed it after
    it had looked for stray exceptions. A plain test's fixture is reported at its teardown."""
    inner.makepyfile(
        """
        import os
        import pytest

        class Noisy:
            def __del__(self):
                if os.environ.get("HARNESS_RANK_WORKER"):  # the ranks' copies only
                    raise RuntimeError("from __del__ of the fixture's value")

        @pytest.fixture
        def made_here():
            return Noisy()  # made in the pytest process; each rank gets a copy

        @pytest.fixture
        def made_in_the_rank(rank):
            yield Noisy()

        @pytest.mark.ranks(2)
        def test_copy(made_here):
            pass

        @pytest.mark.ranks(2)
        def test_own(made_in_the_rank):
            pass
        """
    )
    with warnings.catch_warnings():
        warnings.resetwarnings()
        result = inner.runpytest(
            "-p", "harness", "-W", "error::pytest.PytestUnraisableExceptionWarning"
        )
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*raised PytestUnraisableExceptionWarning*Noisy.__del__*"])


def test_a_hang_in_a_process_a_rank_forked_shows_that_process_and_its_stack(
    inner: pytest.Pytester,
) -> None:
    """A rank that forks a child which hangs: the report showed only the rank waiting for it
    (os.waitpid); the child, and where it hangs, is named."""
    inner.makepyfile(
        """
        import os, threading
        import pytest

        def the_child_waits_here():
            threading.Event().wait()

        @pytest.mark.ranks(2, timeout=3)
        def test_forks(rank):
            if rank == 1:
                child = os.fork()
                if child == 0:
                    the_child_waits_here()
                os.waitpid(child, 0)
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*-- a process this rank forked (pid *) --*",
            "*in the_child_waits_here*",
        ]
    )


def test_a_rank_waiting_in_a_functional_collective_names_the_peer_that_returned(
    inner: pytest.Pytester,
) -> None:
    # DTensor's redistribute waits in the functional collectives' wait_tensor, not in
    # distributed_c10d: the rank that returned without joining is still the root cause.
    inner.makepyfile(
        """
        import pytest, torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        @pytest.mark.ranks(2)
        def test_one_rank_skips_redistribute(rank, world_size):
            mesh = init_device_mesh("cpu", (world_size,))
            d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
            if rank == 0:
                d.redistribute(mesh, [Replicate()])
        """
    )
    result = inner.runpytest("-p", "harness", "--rank-timeout", "8")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 returned while rank 0 *waited in*"])


def test_a_returned_rank_whose_group_an_fsdp_model_holds_still_releases_its_peers(
    inner: pytest.Pytester,
) -> None:
    # The model's reference cycles keep the process group past its destroy, and with it the
    # sockets a waiting peer would see close: the peer waited for the whole timeout.
    inner.makepyfile(
        """
        import pytest, torch, torch.nn as nn, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        @pytest.mark.ranks(2)
        def test_rank_1_returns_holding_a_model(rank):
            fully_shard(nn.Sequential(nn.Linear(4, 4)))
            if rank == 0:
                dist.all_reduce(torch.ones(1))
        """
    )
    result = inner.runpytest("-p", "harness", "--rank-timeout", "30")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 returned while rank 0 waited in all_reduce*"])
    result.stdout.no_fnmatch_line("*still running at the 30 s timeout*")


def test_sys_exit_with_text_is_reported_with_its_text(pytester: pytest.Pytester) -> None:
    """It was reported as "called sys.exit(1)": Python prints the text and exits with 1."""
    pytester.makepyfile(
        """
import sys, pytest

@pytest.mark.ranks(2)
def test_exits_with_words(rank):
    if rank == 1:
        sys.exit("disk full on /scratch")
"""
    )
    result = pytester.runpytest_subprocess("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 failed: called sys.exit('disk full on /scratch')*"])


MISMATCHED_COLLECTIVES = """
import pytest, torch, torch.distributed as dist

@pytest.mark.ranks(4, timeout=120)
def test_an_uneven_last_batch(rank):
    batch = torch.ones(2 if rank == 3 else 1)
    dist.all_reduce(batch)

@pytest.mark.ranks(4, timeout=120)
def test_another_collective_on_one_rank(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 2:
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)

@pytest.mark.ranks(2, timeout=120)
def test_two_ranks_disagree(rank):
    dist.all_reduce(torch.ones(rank + 1))

@pytest.mark.ranks(4, timeout=120)
def test_matching_collectives_pass(rank):
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, src=1)
    assert t.tolist() == [4.0] * 3
"""


def test_a_mismatched_collective_names_the_odd_rank(inner: pytest.Pytester) -> None:
    """One rank all_reduced a tensor of another shape (an uneven last batch): gloo let the
    others return unreduced data, and the harness named them ("ranks 0, 2, 1 returned while
    rank 3 waited"). Each rank's collectives on the harness's group are now compared: the
    odd rank is the root cause, at once, with what it called and what the others did."""
    inner.makepyfile(test_mismatch=MISMATCHED_COLLECTIVES)
    result = inner.runpytest("-p", "harness", "-rA")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines_random(
        [
            "*rank 1 failed: raised CollectiveMismatch: called all_reduce on a tensor of shape "
            "[[]2[]] (float32) as collective 1 on the group; rank 0 called all_reduce on [[]1[]] "
            "(float32) (no call has a majority, so which rank is wrong cannot be told)*",
            "*rank 3 failed: raised CollectiveMismatch: called all_reduce on a tensor of shape "
            "[[]2[]] (float32) as collective 1 on the group; ranks 0, 1, 2 called all_reduce "
            "on [[]1[]] (float32)*",
            "*rank 2 failed: raised CollectiveMismatch: called broadcast on a tensor of shape "
            "[[]1[]] (float32) as collective 2 on the group; ranks 0, 1, 3 called all_reduce "
            "on [[]1[]] (float32)*",
        ]
    )
    assert "timeout" not in result.stdout.str().split("short test summary")[-1]


def test_the_collective_check_can_be_turned_off(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(2, timeout=5)
        def test_an_uneven_last_batch(rank):
            dist.all_reduce(torch.ones(rank + 1))
        """
    )
    result = inner.runpytest("-p", "harness", "--rank-no-collective-check")
    result.assert_outcomes(failed=1)
    assert "CollectiveMismatch" not in result.stdout.str()


def test_collectives_are_compared_in_order_and_the_odd_rank_named() -> None:
    from harness.warm import collective_match

    alike = {r: (2, {0: "all_reduce [1] float32", 1: "barrier"}) for r in range(3)}
    assert collective_match.first_mismatch(alike) is None
    boards = dict(alike)
    boards[1] = (2, {0: "all_reduce [1] float32", 1: "broadcast [1] float32"})
    boards[2] = (1, {0: "all_reduce [1] float32"})  # not there yet: nothing to compare
    assert collective_match.first_mismatch(boards) is None
    boards[2] = (2, {0: "all_reduce [1] float32", 1: "barrier"})
    found = collective_match.first_mismatch(boards)
    assert found is not None and found.index == 1 and found.odd == [1]
    assert found.sentence(1).startswith(
        "called broadcast on a tensor of shape [1] (float32) as collective 2 on the group; "
        "ranks 0, 2 called barrier:"
    )
    # Older than a board keeps (its ring holds the last ones only): not compared.
    assert collective_match.first_mismatch({0: (40, {39: "barrier"}), 1: (40, {})}) is None


FAILS_WITH_COLLATERAL = """
import logging, pytest, torch, torch.distributed as dist

@pytest.mark.ranks(4)
def test_raises_on_3(rank):
    print(f"printed by rank {rank}")
    logging.getLogger("mine").warning("logged by rank %d", rank)
    if rank == 3:
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))
"""


def test_a_report_fits_the_first_screen(inner: pytest.Pytester) -> None:
    """Collateral ranks took a section each (gloo's long transport error, their traceback),
    the same error appeared once per peer in each one's captured log as well, and a rank's
    output and log were printed twice (in its section and again as pytest's). The one line
    each then quoted gloo's error whole ("... Check the logs of the remote worker before
    reporting an error. GLHF!"); it says what happened in the harness's words."""
    inner.makepyfile(test_report=FAILS_WITH_COLLATERAL)
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    # The report itself (under CI, pytest's short summary repeats it whole).
    out = result.stdout.str().split("short test summary info")[0]
    result.stdout.fnmatch_lines(
        [
            "*rank 3 (pid *): raised ValueError: boom [[]root cause[]]*",
            "rank 0 (pid *), waiting in all_reduce: its collective failed as a peer went away "
            "(RuntimeError: Connection closed by peer)",
            "rank 1 (pid *), waiting in all_reduce: the same",
            "rank 2 (pid *), waiting in all_reduce: the same",
        ]
    )
    assert out.count("Connection closed by peer") == 1, out
    assert "GLHF" not in out and "remote worker" not in out  # gloo's words, quoted whole
    assert out.count("logged by rank 0") == 1 and out.count("printed by rank 0") == 1, out
    verbose = inner.runpytest("-p", "harness", "-v")
    verbose.stdout.fnmatch_lines(["*rank 0 (pid *): raised RuntimeError: * [[]collateral[]]*"])


def test_under_ci_the_short_summary_gives_a_ranks_failure_its_headline_only(
    inner: pytest.Pytester,
) -> None:
    """On a CI runner (CI set) pytest prints a failure's whole crash message in the short
    summary: a ranks test's whole report, every rank's section and traceback, came twice."""
    inner.makepyfile(test_report=FAILS_WITH_COLLATERAL)
    os.environ["CI"] = "1"  # inner restores the environment after the test
    result = inner.runpytest("-p", "harness", "-rf")
    result.assert_outcomes(failed=1)
    summary = result.stdout.str().split("short test summary info")[1].splitlines()[1:]
    assert summary[0].startswith("FAILED test_report.py::test_raises_on_3") and (
        "rank 3 failed: raised ValueError: boom" in summary[0]
    ), summary
    assert summary[1].startswith("====") and "1 failed" in summary[1], summary
