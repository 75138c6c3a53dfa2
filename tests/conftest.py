"""Shared test settings: the plugin under test is loaded by pyproject's addopts (-p harness).

pytest-randomly and pytest-rerunfailures (installed for the plugins lane) act in every
session that loads them (randomly shuffles and reseeds; rerunfailures listens on a port
under xdist): pyproject's addopts keeps them off here, and the inner sessions the tests run
(pytester's, in-process or in a subprocess, and other pytest subprocesses) keep them off
through PYTEST_ADDOPTS, unless a test turns one on (`-p randomly` on its command line).
"""

from __future__ import annotations

import os

import pytest

PLUGINS_OFF = "-p no:randomly -p no:rerunfailures"
os.environ["PYTEST_ADDOPTS"] = " ".join(
    part for part in (os.environ.get("PYTEST_ADDOPTS", ""), PLUGINS_OFF) if part
)


@pytest.fixture(autouse=True)
def _no_randomly_in_inner_sessions(request: pytest.FixtureRequest) -> None:
    """pytester empties PYTEST_ADDOPTS for its test: put pytest-randomly's opt-out back."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")
        request.getfixturevalue("monkeypatch").setenv("PYTEST_ADDOPTS", PLUGINS_OFF)


class StartedAProcess(AssertionError):
    """A test marked `unit` started a process: it belongs in another lane, or needs a fake."""


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest) -> None:
    """`unit` tests (make unit-fast) test logic with fakes: starting a process fails them.
    Other tests get nothing from this fixture (no monkeypatch asked for on their behalf)."""
    if request.node.get_closest_marker("unit") is None:
        return
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    import multiprocessing.process
    import subprocess

    def refused(*args: object, **kwargs: object) -> None:
        raise StartedAProcess(
            f"{request.node.nodeid} is marked unit but started a process: use a fake, or "
            f"move it out of the unit lane"
        )

    monkeypatch.setattr(os, "fork", refused)
    monkeypatch.setattr(os, "posix_spawn", refused)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refused)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refused)
