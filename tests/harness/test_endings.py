"""What a body did in a rank, turned into its outcome record, tested directly in this
process: each way a body ends, the traceback that starts at the user's code, a return value
that cannot travel, and a str() that fails."""

from __future__ import annotations

import pickle
import sys
import threading
import unittest
from typing import Any, NoReturn

import pytest

from harness.common import endings
from harness.common.outcome import Ending

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


def _caught(body: Any) -> BaseException:
    try:
        body()
    except BaseException as exc:
        return exc
    raise AssertionError("the body did not raise")


def _fails() -> NoReturn:
    raise ValueError("bad batch")


def test_an_error_is_raised_with_its_classes_message_and_traceback() -> None:
    outcome = endings.ended_by("t0", 1, _caught(_fails))
    assert outcome.ending is Ending.RAISED and outcome.rank == 1
    assert outcome.exc_type == "builtins.ValueError" and outcome.message == "bad batch"
    assert outcome.exc_classes[:2] == ("builtins.ValueError", "builtins.Exception")
    assert "in _fails" in outcome.traceback and 'raise ValueError("bad batch")' in outcome.traceback


@pytest.mark.parametrize(
    ("code", "exit_code", "said"), [(3, 3, ""), (None, 0, ""), ("why", 1, "why")]
)
def test_sys_exit_is_an_exit_with_its_code(
    code: Any, exit_code: int, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    outcome = endings.ended_by("t0", 0, _caught(lambda: sys.exit(code)))
    assert (outcome.ending, outcome.exit_code, outcome.message) == (Ending.EXITED, exit_code, said)
    assert capsys.readouterr().err == (f"{said}\n" if said else "")  # as Python prints it


def test_pytest_and_unittest_skips_are_skips_and_xfail_an_xfail() -> None:
    skipped = endings.ended_by("t0", 0, _caught(lambda: pytest.skip("no GPU")))
    assert (skipped.ending, skipped.message) == (Ending.SKIPPED, "no GPU")
    assert skipped.skipped_at is not None and skipped.skipped_at[0] == __file__
    assert endings.ended_by("t0", 0, _caught(_skip_test)).ending is Ending.SKIPPED
    xfailed = endings.ended_by("t0", 0, _caught(lambda: pytest.xfail("known")))
    assert (xfailed.ending, xfailed.message) == (Ending.XFAILED, "known")


def _skip_test() -> NoReturn:
    raise unittest.SkipTest("not here")


def test_a_class_named_like_pytests_skip_is_an_error() -> None:
    class Skipped(Exception):
        pass

    def body() -> NoReturn:
        raise Skipped("mine")

    assert endings.ended_by("t0", 0, _caught(body)).ending is Ending.RAISED


def test_the_root_cause_a_collective_names_is_kept() -> None:
    def body() -> NoReturn:
        error = RuntimeError("rank 2 failed")
        error.origin_rank = 2  # type: ignore[attr-defined]
        raise error

    assert endings.ended_by("t0", 0, _caught(body)).origin_rank == 2


def test_a_return_value_travels_pickled_or_says_why_it_cannot() -> None:
    kept = endings.returned("t0", 0, {"loss": 1.5})
    assert kept.value_repr == "{'loss': 1.5}" and pickle.loads(kept.value_blob or b"") == {
        "loss": 1.5
    }
    lost = endings.returned("t0", 0, threading.Lock())
    assert lost.value_blob is None and "could not be sent back" in lost.notes[0]
    assert endings.returned("t0", 0, None).value_repr == ""  # nothing returned: nothing shown


def test_a_value_whose_str_and_repr_fail_is_still_named() -> None:
    class Broken:
        def __str__(self) -> str:
            raise RuntimeError

        def __repr__(self) -> str:
            raise RuntimeError

    assert endings.text_of(Broken()) == "<str() of Broken raised RuntimeError>"
    assert endings.safe_repr(Broken()) == "<Broken>"
    assert len(endings.safe_repr("x" * 1000)) == 500


def test_a_coroutine_fails_as_pytest_fails_it_and_is_closed() -> None:
    async def body() -> None:
        pass

    coroutine: Any = body()
    # pytest 8.4 fails such a test; before, it skips it with the same words.
    as_pytest = pytest.fail.Exception if pytest.version_tuple >= (8, 4) else pytest.skip.Exception
    with pytest.raises(as_pytest, match="async def functions are not natively"):
        endings.refuse_awaitable(coroutine)
    assert coroutine.cr_frame is None  # closed: no "never awaited" warning
    endings.refuse_awaitable(3)  # anything else: nothing to refuse
