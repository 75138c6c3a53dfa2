"""pytest's warning filters as a rank applies them, and rank warnings as the pytest process
says them again, tested directly in this process (in whole sessions:
test_pytest_fixtures.py and test_verdicts.py)."""

from __future__ import annotations

import threading
import warnings

import pytest

from harness.common import rank_warnings
from harness.common.outcome import RankWarning
from harness.common.protocol import WarningFilters
from tests.harness.conftest import outcome

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


def test_the_ini_s_error_filter_fails_the_rank_and_a_closer_mark_ignores() -> None:
    errors = WarningFilters(config=("error::UserWarning",))
    with pytest.raises(UserWarning, match="loud"), rank_warnings.recording(errors):
        warnings.warn("loud", UserWarning, stacklevel=1)
    marked = WarningFilters(config=("error::UserWarning",), marks=("ignore:loud",))
    with rank_warnings.recording(marked) as log:
        warnings.warn("loud", UserWarning, stacklevel=1)
    assert log == []


def test_deprecations_are_recorded_unless_python_was_given_w() -> None:
    with rank_warnings.recording(WarningFilters()) as log:
        warnings.warn("old", DeprecationWarning, stacklevel=1)
    found = rank_warnings.collected(log)
    assert [(w.category, w.message) for w in found] == [("builtins.DeprecationWarning", "old")]
    assert found[0].filename == __file__


def test_a_warning_from_several_ranks_is_said_once_naming_them() -> None:
    said = RankWarning("builtins.UserWarning", "slow", __file__, 7)
    other = RankWarning("no.such.module.Warning", "odd", __file__, 8)
    outcomes = [outcome(0, warnings=(said,)), outcome(1, warnings=(said, other)), outcome(2)]
    with warnings.catch_warnings(record=True) as shown:
        rank_warnings.reemit(outcomes)
    assert [(w.category, str(w.message), w.lineno) for w in shown] == [
        (UserWarning, "[ranks 0, 1] slow", 7),
        (UserWarning, "[rank 1] odd", 8),  # a category that cannot be found: UserWarning
    ]


def test_a_threads_stray_exception_is_a_warning_an_error_filter_raises() -> None:
    with rank_warnings.stray_exceptions(frozenset({"thread"})) as stray:
        thread = threading.Thread(target=lambda: 1 / 0, name="worker")
        thread.start()
        thread.join()
    assert threading.excepthook is not stray.thread  # put back
    unhandled = pytest.PytestUnhandledThreadExceptionWarning
    with pytest.raises(unhandled, match="thread worker"), warnings.catch_warnings():
        warnings.simplefilter("error")
        stray.warn()
