"""Rank labels on the ranks' output in junit xml.

pytest's junit writer (``-o junit_logging=all``, ``system-out``, ...) joins a test's
captured sections into ``<system-out>`` and ``<system-err>`` without their titles, so the
ranks' output (a section each, titled ``stdout [rank N]``) would arrive unlabelled. While a
report is logged, the writer sees each rank's lines prefixed with ``[rank N] ``; the report
itself, and the terminal's sections, keep them as the ranks printed them.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Any

import pytest

from harness.common import pytest_internals

# A rank's section, as pytest titles it: "Captured stdout [rank 1] call".
_RANK_SECTION = re.compile(r"^Captured \w+ \[rank (\d+)\]")


class JunitLabels:
    """The hook that labels the ranks' lines while junit xml reads a report."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, Any, Any]:
        sections = report.sections
        if self._junit_keeps_output():
            report.sections = labelled(sections)
        try:
            return (yield)
        finally:
            report.sections = sections

    def _junit_keeps_output(self) -> bool:
        """Whether the session writes junit xml with captured output (asked as reports come:
        its writer may be configured after the harness)."""
        key = pytest_internals.junit_xml_key()
        writer = None if key is None else self._config.stash.get(key, None)
        return writer is not None and getattr(writer, "logging", "no") != "no"


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(JunitLabels(config), "harness-junit-labels")


def labelled(sections: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`sections` with each line of a rank's section prefixed by its rank."""
    found = []
    for title, content in sections:
        match = _RANK_SECTION.match(title)
        if match is not None:
            prefix = f"[rank {match[1]}] "
            content = "".join(prefix + line for line in content.splitlines(keepends=True))
        found.append((title, content))
    return found
