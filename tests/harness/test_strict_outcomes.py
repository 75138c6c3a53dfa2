"""Every rank's end counts: each false green the incumbents give is a red here, with its cause."""

from __future__ import annotations

import pytest

RANK1_DOES = """
import ctypes, os, signal, sys
import pytest, torch.distributed as dist

@pytest.mark.ranks(4)
def test_rank1(rank):
    print(f"rank {{rank}} says hello")
    if rank == 1:
        {action}
    dist.barrier()
"""


PEERS_BOUND_S = 120


@pytest.mark.parametrize(
    ("action", "summary"),
    [
        ("sys.exit(3)", "rank 1 failed: called sys.exit(3); ranks 0, 2, 3 collateral*"),
        ("sys.exit(0)", "rank 1 failed: called sys.exit(0); ranks 0, 2, 3 collateral*"),
        ("os._exit(3)", "rank 1 failed: process exited with status 3; ranks 0, 2, 3 collateral*"),
        ("ctypes.string_at(0)", "rank 1 failed: died of SIGSEGV; ranks 0, 2, 3 collateral*"),
        (
            "os.kill(os.getpid(), signal.SIGKILL)",
            "rank 1 failed: died of SIGKILL; ranks 0, 2, 3 collateral*",
        ),
        (
            "assert [1, 2] == [1, 3]",
            "rank 1 failed: raised AssertionError: assert [[]1, 2[]] == [[]1, 3[]]; "
            "ranks 0, 2, 3 collateral*",
        ),
    ],
    ids=["sys.exit(3)", "sys.exit(0)", "os._exit", "segfault", "sigkill", "assert"],
)
def test_one_bad_rank_fails_the_test_with_its_cause(
    inner: pytest.Pytester, action: str, summary: str
) -> None:
    inner.makepyfile(RANK1_DOES.format(action=action))
    result = inner.runpytest("-p", "harness", "--rank-timeout", str(PEERS_BOUND_S))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([summary, "*rank 1 (pid *)*[[]root cause[]]*"])
    # Peers blocked in the barrier fail at once: nobody waited for the test's timeout (a
    # bound far above the normal second or two, so a busy machine cannot cross it).
    result.stdout.no_fnmatch_line("*hung*")
    assert result.duration < PEERS_BOUND_S


def test_the_root_cause_section_has_values_traceback_and_output(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_r=RANK1_DOES.format(action="assert [1, 2] == [1, 3]"))
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(
        [
            "*rank 1 (pid *): raised AssertionError* [[]root cause[]]*",
            "Traceback (most recent call last):",
            "*test_r.py*, line 8, in test_rank1",
            "*assert [[]1, 2[]] == [[]1, 3[]]",
            "*At index 1 diff: 2 != 3*",
            "*collateral: one line each*",
            "rank 0 (pid *)*",
            "*Captured stdout [[]rank 1[]] call*",  # once, as pytest shows a test's output
            "rank 1 says hello",
        ]
    )
    # The summary line is the test's one-line reason in pytest's short summary.
    result.stdout.fnmatch_lines(["FAILED *test_rank1* - Failed: rank 1 failed: raised Assert*"])


def test_a_rank_that_crashes_shows_where_it_crashed(inner: pytest.Pytester) -> None:
    """A segfault's verdict was right but its section empty, where plain pytest shows
    faulthandler's stack down to the test's line: the rank's section shows that stack,
    its frames with their source lines, without the harness's frames below the test."""
    inner.makepyfile(
        test_crash="""
        import ctypes
        import pytest

        def crash_here():
            ctypes.string_at(0)

        @pytest.mark.ranks(2)
        def test_crash(rank):
            if rank == 1:
                crash_here()

        @pytest.mark.ranks(2)
        def test_next_is_clean(rank):
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 1 (pid *): died of SIGSEGV [[]root cause[]]*",
            "Fatal Python error: Segmentation fault",
            "*test_crash.py*, line 5 in crash_here",
            "    ctypes.string_at(0)",
            "*test_crash.py*, line 10 in test_crash",
            "    crash_here()",
        ]
    )
    text = result.stdout.str()
    assert "harness/rank/" not in text and "multiprocessing" not in text, text


def test_the_first_failure_in_time_is_the_root_cause_not_rank_order(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(3)
        def test_late_and_early(rank):
            if rank == 2:
                raise KeyError("first")
            t = torch.ones(1)
            dist.all_reduce(t)  # ranks 0 and 1 fail here, after rank 2
            if rank == 0:
                raise RuntimeError("never reached")
        """
    )
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(["rank 2 failed: raised KeyError: 'first'; ranks 0, 1 collateral*"])


def test_independent_failures_are_not_called_collateral(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_both(rank):
            raise ValueError(f"rank {rank} is unhappy")
        """
    )
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(
        ["rank * failed: raised ValueError: rank * is unhappy; rank * also failed*"]
    )


def test_skip_on_every_rank_skips(inner: pytest.Pytester) -> None:
    path = inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks
        def test_skipped(rank):
            if rank >= 0:
                pytest.skip("not today")
        """
    )
    result = inner.runpytest("-p", "harness", "-rs")
    result.assert_outcomes(skipped=1)
    # Where the ranks skipped, as pytest says where a plain test did (not the test's line).
    line = path.read_text().splitlines().index('        pytest.skip("not today")') + 1
    result.stdout.fnmatch_lines([f"SKIPPED [[]1[]] {path.name}:{line}: not today"])


def test_a_failed_test_does_not_poison_the_next(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import os, pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(4)
        def test_a_fails(rank):
            if rank == 2:
                raise ValueError("boom")
            dist.barrier()

        @pytest.mark.ranks(4)
        def test_b_dies(rank):
            if rank == 3:
                os._exit(9)
            dist.barrier()

        @pytest.mark.ranks(4)
        def test_c_passes(rank):
            print("c output")
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 4
        """
    )
    result = inner.runpytest("-p", "harness", "-v")
    result.stdout.fnmatch_lines(
        ["*test_a_fails* FAILED*", "*test_b_dies* FAILED*", "*test_c_passes* PASSED*"]
    )
