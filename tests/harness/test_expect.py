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

    from harness.expect import RANKWISE_ABORT_EXIT_CODE

    assert RANKWISE_ABORT_EXIT_CODE == ABORT_EXIT_CODE
