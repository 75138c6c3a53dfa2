"""The sequence after a body ran on every rank, tested directly with a fake item: a rank's
pytest.exit() or Ctrl-C, returned values, replaced ranks, leftovers at teardown, every rank's
output on the report, and warnings the filters make errors."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from harness.common.outcome import Ending
from harness.pytest_side import runner
from tests.harness.conftest import outcome

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


def _item() -> Any:
    sections: list[tuple[str, str, str]] = []
    return SimpleNamespace(
        nodeid="t.py::test_x",
        stash=pytest.Stash(),
        sections=sections,
        add_report_section=lambda when, key, content: sections.append((when, key, content)),
    )


def test_pytest_exit_on_a_rank_ends_the_session_with_its_words_and_status() -> None:
    exited = outcome(1, Ending.RAISED, exc_type="_pytest.outcomes.Exit", message="bye", exit_code=4)
    with pytest.raises(pytest.exit.Exception, match=r"\[rank 1\] bye") as stopped:
        runner.stop_if_a_rank_did([outcome(0), exited])
    assert stopped.value.returncode == 4


def test_ctrl_c_on_a_rank_is_a_keyboard_interrupt_here() -> None:
    pressed = outcome(2, Ending.RAISED, exc_type="builtins.KeyboardInterrupt")
    with pytest.raises(KeyboardInterrupt, match="in rank 2"):
        runner.stop_if_a_rank_did([pressed])


def test_leftovers_are_one_error_at_teardown_naming_each_rank() -> None:
    item = _item()
    left = [
        outcome(0, leftovers={"threads": "left thread 'poller' running"}),
        outcome(1, leftovers={"environ": "changed os.environ['X']"}),
    ]
    runner.record_leftovers(item, left)
    with pytest.raises(runner.RankLeftovers) as raised:
        runner.raise_leftovers(item)
    assert str(raised.value).splitlines() == [
        "hygiene: rank 0 left thread 'poller' running",
        "rank 1 changed os.environ['X']",
        "(a test that means it: @pytest.mark.allow_leftovers('threads'))",  # the kinds allowed
    ]
    assert runner.leftovers_text([outcome(0)]) is None


def test_every_ranks_output_is_a_section_of_its_own() -> None:
    item = _item()
    runner.attach_output(item, [outcome(0, stdout="hi\n"), outcome(1, stderr="oops\n", log="L")])
    assert item.sections == [
        ("call", "stdout [rank 0]", "hi\n"),
        ("call", "stderr [rank 1]", "oops\n"),
        ("call", "log [rank 1]", "L"),
    ]


def test_a_returned_value_and_replaced_ranks_are_warned_of() -> None:
    item = _item()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        runner._warn_of_returned_values(item, [outcome(0, value_repr="3"), outcome(1)])
        replaced = outcome(1, replace_after="left a thread running")
        runner.warn_of_replaced_ranks(item, [outcome(0), replaced])
    assert [type(w.message) for w in shown] == [
        pytest.PytestReturnNotNoneWarning,
        runner.RanksReplacedWarning,
    ]
    assert "returned 3 on rank 0" in str(shown[0].message)
    assert "rank 1 left a thread running" in str(shown[1].message)
    assert "allow_leftovers('threads')" in str(shown[1].message)


def test_a_warning_the_filters_make_an_error_fails_the_test_after_its_output() -> None:
    item = _item()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.warn_of_replaced_ranks(item, [outcome(0, replace_after="died")])
    with pytest.raises(pytest.fail.Exception, match=r"RanksReplacedWarning \(an error under"):
        runner.raise_warnings_made_errors(item)
    runner.raise_warnings_made_errors(item)  # said once
