"""Small pytest-side parts tested directly, without a session: the ranks' labels in junit
xml's output, and which report files a launched rank other than 0 leaves to rank 0."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness.launched.reports import REPORT_FILE_OPTIONS, turn_off_report_files
from harness.pytest_side.junit_labels import labelled

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


def test_each_ranks_lines_are_labelled_and_other_sections_kept() -> None:
    sections = [
        ("Captured stdout [rank 1] call", "one\ntwo\n"),
        ("Captured stderr [rank 0] setup", "warned"),
        ("Captured stdout call", "the pytest process's own\n"),
        ("Captured log [rank 2] call", ""),
    ]
    assert labelled(sections) == [
        ("Captured stdout [rank 1] call", "[rank 1] one\n[rank 1] two\n"),
        ("Captured stderr [rank 0] setup", "[rank 0] warned"),
        ("Captured stdout call", "the pytest process's own\n"),
        ("Captured log [rank 2] call", ""),
    ]


def test_the_labels_are_a_copy_the_report_keeps_its_own() -> None:
    sections = [("Captured stdout [rank 3] call", "x\n")]
    labelled(sections)
    assert sections == [("Captured stdout [rank 3] call", "x\n")]


def _config(**options: Any) -> Any:
    return SimpleNamespace(option=SimpleNamespace(**options))


def test_every_report_file_option_set_is_turned_off() -> None:
    config = _config(
        xmlpath="junit.xml", report_log="log.jsonl", htmlpath="r.html", json_report=True
    )
    turn_off_report_files(config)
    assert vars(config.option) == REPORT_FILE_OPTIONS


def test_a_report_plugin_not_installed_is_left_alone() -> None:
    config = _config(xmlpath="junit.xml")  # no pytest-html, reportlog or json-report here
    turn_off_report_files(config)
    assert vars(config.option) == {"xmlpath": None}
