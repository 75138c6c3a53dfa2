"""Expected outcomes (a matching and a mismatching case per form), hygiene, cross-rank asserts."""

from __future__ import annotations

import pytest

HEADER = """
import os, signal, sys, threading, pytest, torch, torch.distributed as dist
import rankwise as rw
from harness import aborts, exits, hangs, killed, raises, returns
"""

# (expectation on rank 1, body on rank 1, matches?)
FORMS = {
    "returns-ok": ("returns()", "pass", True),
    "returns-bad": ("returns()", "raise ValueError('no')", False),
    "raises-ok": ("raises(ValueError)", "raise ValueError('no')", True),
    "raises-subclass-ok": ("raises(LookupError)", "raise KeyError('k')", True),
    "raises-bad-type": ("raises(TypeError)", "raise ValueError('no')", False),
    "raises-match-ok": (
        "raises(ValueError, match='batch [0-9]+')",
        "raise ValueError('batch 7')",
        True,
    ),
    "raises-match-bad": ("raises(ValueError, match='epoch')", "raise ValueError('batch 7')", False),
    "exits-ok": ("exits(3)", "sys.exit(3)", True),
    "exits-hard-ok": ("exits(3)", "os._exit(3)", True),
    "exits-bad-code": ("exits(3)", "sys.exit(4)", False),
    "killed-ok": ("killed(signal.SIGKILL)", "os.kill(os.getpid(), signal.SIGKILL)", True),
    "killed-bad": ("killed(signal.SIGTERM)", "os.kill(os.getpid(), signal.SIGKILL)", False),
    "aborts-ok": (
        "aborts()",
        "from rankwise._run import abort\n        try:\n            raise ValueError('x')\n"
        "        except ValueError:\n            abort()",
        True,
    ),
    "aborts-bad": ("aborts()", "os._exit(1)", False),
    "hangs-ok": ("hangs()", "threading.Event().wait()", True),
    "hangs-bad": ("hangs()", "pass", False),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_expected_outcome_form(inner: pytest.Pytester, form: str) -> None:
    expected, body, matches = FORMS[form]
    inner.makepyfile(
        HEADER
        + f"""
@pytest.mark.ranks(2, timeout=3)
@pytest.mark.expect(rank=1, does={expected}, others=returns())
def test_form(rank):
    if rank == 1:
        {body}
"""
    )
    result = inner.runpytest("-p", "harness")
    if matches:
        result.assert_outcomes(passed=1)
        return
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "expected outcomes not met on rank 1  [[]2 ranks, *test_form*[]]",
            "rank | expected*| got",
            "0    | returns*| returned",
            "1    | *  <-",
        ]
    )


def test_the_per_rank_and_all_ranks_forms(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
@pytest.mark.ranks(3)
@pytest.mark.expect({0: returns(), 2: exits(2)})
def test_dict(rank):
    if rank == 2:
        sys.exit(2)

@pytest.mark.ranks(3)
@pytest.mark.expect(exits(6))
def test_all(rank):
    rw.all_reduce("x", lambda: sys.exit(6) if rank == 0 else 1, sum)

@pytest.mark.ranks(3)
@pytest.mark.expect(rank=[0, 2], does=raises(ZeroDivisionError), others=raises(RuntimeError))
def test_list(rank):
    rw.all_reduce("x", lambda: 1 / (rank % 2), sum)

@pytest.mark.ranks(3)
@pytest.mark.expect({0: returns(), 1: returns(), 2: returns()})
def test_dict_mismatch(rank):
    if rank == 0:
        raise KeyError("nope")
"""
    )
    result = inner.runpytest("-p", "harness", "-v")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        ["*expected outcomes not met on rank 0*", "0 * | returns * | raised KeyError: 'nope'  <-"]
    )


def test_bad_expectations_say_where_they_came_from(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
@pytest.mark.ranks(2)
@pytest.mark.expect({5: returns()})
def test_bad(rank):
    pass
"""
    )
    result = inner.runpytest("-p", "harness")
    result.stderr.fnmatch_lines(
        ["*invalid expected outcome rank 5: use ranks 0..1 from the expect marker on *test_bad*"]
    )


# ---- hygiene ---------------------------------------------------------------------------------


def test_leftovers_are_errors_naming_the_rank_unless_allowed(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
import time

STOP = threading.Event()

@pytest.mark.ranks(2, launch=True)
def test_group_left(rank):
    dist.init_process_group("gloo")

@pytest.mark.ranks(2)
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
            "*hygiene: rank 1 left non-daemon threads running: poller; join them*",
            "*ERROR at teardown of test_env_left*",
            "*hygiene: rank 0 changed environment variables LEFT_BEHIND*",
        ]
    )


def test_a_bad_leftover_kind_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
@pytest.mark.ranks(2)
@pytest.mark.allow_leftovers("files")
def test_bad(rank):
    pass
"""
    )
    result = inner.runpytest("-p", "harness")
    result.stderr.fnmatch_lines(
        ["*invalid leftover kind(s) [[]'files'[]] from the allow_leftovers marker on *test_bad*"]
    )


def test_leftover_processes_at_session_end_fail_the_session(inner: pytest.Pytester) -> None:
    inner.makeconftest(
        """
        import harness.pool
        harness.pool._alive = lambda pid: True  # pretend no rank would die
        """
    )
    inner.makepyfile(HEADER + "\n@pytest.mark.ranks(2)\ndef test_x(rank):\n    pass\n")
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(["*harness: rank processes still alive at session end: [[]*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


# ---- cross-rank assertions ---------------------------------------------------------------------


def test_cross_rank_assertions_fail_every_rank_together(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
from harness import assert_close_across_ranks, assert_on_all_ranks

CONDITION = r"condition false on rank\\(s\\) \\[2\\] of 4 \\(rank 2: loss is nan\\)"
CLOSE = r"differs from rank 0's on 1 of 4 ranks: rank 3: "

@pytest.mark.ranks(4)
@pytest.mark.expect(raises(AssertionError, match=CONDITION))
def test_condition(rank):
    assert_on_all_ranks(rank != 2, "loss is nan" if rank == 2 else "")
    dist.barrier()  # every rank raised above: nobody waits here

@pytest.mark.ranks(4)
@pytest.mark.expect(raises(AssertionError, match=CLOSE))
def test_close(rank):
    assert_close_across_ranks(torch.ones(3) + (0.5 if rank == 3 else 0.0))

@pytest.mark.ranks(4)
def test_agreeing(rank):
    assert_on_all_ranks(True)
    assert_close_across_ranks(torch.ones(3) * (1 + rank * 1e-9), rtol=1e-6, atol=0)
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=3)


def test_the_abort_code_is_the_one_rankwise_uses() -> None:
    from rankwise._run import ABORT_EXIT_CODE

    from harness.expect import RANKWISE_ABORT_EXIT_CODE

    assert RANKWISE_ABORT_EXIT_CODE == ABORT_EXIT_CODE
