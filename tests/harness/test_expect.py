"""Expected outcomes: a matching and a mismatching case per form, and bad declarations."""

from __future__ import annotations

import pytest

from tests.harness.conftest import HEADER

# (expectation on rank 1, body on rank 1, matches?)
FORMS = {
    "returns-ok": ("returns()", "pass", True),
    "returns-bad": ("returns()", "raise ValueError('no')", False),
    "raises-ok": ("raises(ValueError)", "raise ValueError('no')", True),
    "raises-subclass-ok": ("raises(LookupError)", "raise KeyError('k')", True),
    "raises-bad-type": ("raises(TypeError)", "raise ValueError('no')", False),
    "raises-same-name-other-class-bad": (  # a class of the test's own named like a builtin
        "raises(type('TimeoutError', (Exception,), {}))",
        "raise TimeoutError('the builtin')",
        False,
    ),
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

def test_others_still_run():
    pass
"""
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*invalid expected outcome rank 5 from the expect marker on *test_bad*: use ranks 0..1"]
    )


def test_the_abort_code_is_the_one_rankwise_uses() -> None:
    from rankwise._run import ABORT_EXIT_CODE

    from harness.common.expect import RANKWISE_ABORT_EXIT_CODE

    assert RANKWISE_ABORT_EXIT_CODE == ABORT_EXIT_CODE


def test_a_fault_that_never_fired_meets_no_expected_exception(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
import harness

@pytest.mark.ranks(2)
@pytest.mark.fault(rank=1, kind="raise", exc=OSError("disk full"), at="laod")  # misspelt
@pytest.mark.expect(rank=1, does=raises(Exception), others=returns())
def test_any_exception(rank):
    harness.fault_point("load")

@pytest.mark.ranks(2)
@pytest.mark.fault(rank=1, kind="raise", exc=OSError("disk full"), at="load", nth=2)
@pytest.mark.expect(rank=1, does=raises(BaseException), others=returns())
def test_any_base_exception(rank):
    harness.fault_point("load")
"""
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*fault * was never reached on rank 1*"] * 2)


def test_an_exception_whose_str_fails_is_still_named(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")

@pytest.mark.ranks(2)
@pytest.mark.expect(rank=1, does=raises(Unprintable), others=returns())
def test_expected(rank):
    if rank == 1:
        raise Unprintable()

@pytest.mark.ranks(2)
def test_reported(rank):
    if rank == 1:
        raise Unprintable()
"""
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*rank 1 failed: raised Unprintable: <str() of Unprintable raised*"]
    )


def test_an_expected_failure_leaves_its_peers_the_whole_timeout(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an ending the test declares (or an xfail), a slower peer may still finish. So
    may one after an undeclared failure: only a peer waiting on the failed rank is cut at
    the grace, so a slow one ends on its own and did not hang (hangs() does not take it)."""
    monkeypatch.setenv("_HARNESS_TEST_FAILURE_GRACE_S", "0.2")
    inner.makepyfile(
        HEADER
        + """
import time

def outlast_the_grace(shared_tmp_path):
    deadline = time.monotonic() + 60
    while not (shared_tmp_path / "failed").exists():  # rank 0 is about to end
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(1.0)  # slow work: five times the grace, well inside the timeout

def fail_first(shared_tmp_path):
    (shared_tmp_path / "failed").touch()

@pytest.mark.ranks(2, timeout=30)
@pytest.mark.expect(rank=0, does=raises(ValueError), others=returns())
def test_declared_raise(rank, shared_tmp_path):
    if rank == 0:
        fail_first(shared_tmp_path)
        raise ValueError("as declared")
    outlast_the_grace(shared_tmp_path)

@pytest.mark.ranks(2, timeout=30)
@pytest.mark.expect(rank=0, does=exits(3), others=returns())
def test_declared_exit(rank, shared_tmp_path):
    if rank == 0:
        fail_first(shared_tmp_path)
        sys.exit(3)
    outlast_the_grace(shared_tmp_path)

@pytest.mark.ranks(2, timeout=30)
def test_xfail_on_one_rank(rank, shared_tmp_path):
    if rank == 0:
        fail_first(shared_tmp_path)
        pytest.xfail("known")
    outlast_the_grace(shared_tmp_path)

@pytest.mark.ranks(2, timeout=30)
@pytest.mark.expect(rank=1, does=hangs(), others=returns())
def test_slow_is_not_hung(rank, shared_tmp_path):
    if rank == 0:
        fail_first(shared_tmp_path)
        raise ValueError("undeclared")  # the grace starts: rank 1 waits on no one, and runs on
    outlast_the_grace(shared_tmp_path)
"""
    )
    result = inner.runpytest("-p", "harness", "-rxX")
    result.assert_outcomes(passed=2, xfailed=1, failed=1)
    result.stdout.fnmatch_lines(["*1 * | hangs * | returned  <-*"])


def test_an_unmet_expectation_caused_by_a_peer_names_that_peer_the_root_cause(
    inner: pytest.Pytester,
) -> None:
    """Rank 1 was expected to raise, but rank 0's expected exit reached it through rankwise
    (a SystemExit travels as it is): rank 0 caused it, whose own ending was as expected."""
    inner.makepyfile(
        HEADER
        + """
@pytest.mark.ranks(2)
@pytest.mark.fault(rank=0, kind="exit", code=3, at="batch")
@pytest.mark.expect(rank=0, does=exits(3), others=raises(RuntimeError))
def test_wrong_guess(rank):
    rw.all_reduce("batch", lambda: 1, sum)
"""
    )
    result = inner.runpytest("-p", "harness", "-v")  # every collateral rank's section
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*expected outcomes not met on rank 1*",
            "*rank 0 (pid *): called sys.exit(3) [[]root cause[]]*",
            "*rank 1 (pid *): called sys.exit(3) [[]collateral[]]*",
        ]
    )
