"""Under torchrun, rank 0 alone writes the session's report files (junit, report logs, HTML).

Every launched process is a pytest session given the same command line, so each would write
the same files over the others'. On ranks other than 0 the report plugins' file options are
turned off before those plugins read them: this module's ``pytest_configure`` runs first.
Imports no torch.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.common import launch_detect

# Options naming a file a report plugin writes, and their value when off.
REPORT_FILE_OPTIONS: dict[str, Any] = {
    "xmlpath": None,  # --junitxml
    "report_log": None,  # pytest-reportlog's --report-log
    "htmlpath": None,  # pytest-html's --html
    "json_report": False,  # pytest-json-report's --json-report
}


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    try:
        launch = launch_detect.detect()
    except launch_detect.LaunchError:
        return  # the plugin's own configure stops the session with the fix
    if launch is not None and launch.rank != 0:
        turn_off_report_files(config)


def turn_off_report_files(config: pytest.Config) -> None:
    for option, off in REPORT_FILE_OPTIONS.items():
        if getattr(config.option, option, off) != off:
            setattr(config.option, option, off)
