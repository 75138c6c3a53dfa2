"""pytest's fixtures made inside a rank: each rank gets its own, undone in the rank.

``capsys``/``capfd`` (and their binary forms) capture this rank's output, ``caplog`` its log
records, ``recwarn`` its warnings, ``monkeypatch`` patches and undoes here, ``tmp_path`` and
``tmpdir`` are this rank's own directory, and ``request`` is a snapshot of the pytest-side
request (node, markers, parameters, options) whose ``addfinalizer`` runs in the rank. Runs
inside ranks; imports pytest, not torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.protocol import RANK_SIDE_FIXTURES, RequestInfo


class RankNode:
    """What a test's node tells a rank: names, keywords and markers."""

    def __init__(self, info: RequestInfo) -> None:
        self.name = info.name
        self.nodeid = info.nodeid
        self.keywords = dict.fromkeys(info.keywords, True)
        self.own_markers = [pytest.Mark(n, a, k, _ispytest=True) for n, a, k in info.markers]

    def iter_markers(self, name: str | None = None) -> Iterator[pytest.Mark]:
        return (m for m in self.own_markers if name is None or m.name == name)

    def get_closest_marker(self, name: str, default: Any = None) -> Any:
        return next(self.iter_markers(name), default)

    def __repr__(self) -> str:
        return f"<RankNode {self.nodeid}>"


class RankConfig:
    """The pytest process's option and ini values, as they were when the test ran."""

    def __init__(self, info: RequestInfo) -> None:
        self._options = info.options
        self._ini = info.ini

    def getoption(self, name: str, default: Any = None, skip: bool = False) -> Any:
        if name in self._options:
            return self._options[name]
        if skip:
            pytest.skip(f"no {name!r} option found")
        return default

    def getini(self, name: str) -> Any:
        if name not in self._ini:
            raise ValueError(f"unknown ini key {name!r} (or its value could not travel)")
        return self._ini[name]


class RankRequest:
    """The test's ``request`` inside a rank; ``addfinalizer`` runs there after the test."""

    def __init__(self, info: RequestInfo) -> None:
        self.node = RankNode(info)
        self.config = RankConfig(info)
        self.fixturenames = list(info.fixturenames)
        self.keywords = self.node.keywords
        self._param, self._has_param = info.param, info.has_param
        self._finalizers: list[Callable[[], object]] = []

    @property
    def param(self) -> Any:
        if not self._has_param:
            raise AttributeError("'request' of a test function has no 'param'")
        return self._param

    def addfinalizer(self, finalizer: Callable[[], object]) -> None:
        self._finalizers.append(finalizer)

    def run_finalizers(self) -> None:
        while self._finalizers:
            self._finalizers.pop()()


# The fixtures RankFixtures.make makes (the rank fills `rank` and `device` in as plain values).
MADE_HERE = frozenset(RANK_SIDE_FIXTURES) - {"rank", "device"}


class RankFixtures:
    """Makes the fixtures a test asked for in this rank, and undoes them after the body."""

    def __init__(self, rank: int, info: RequestInfo | None) -> None:
        self._rank = rank
        self._request = RankRequest(info) if info is not None else None
        self._stack = contextlib.ExitStack()

    def make(self, sent: dict[str, Any]) -> dict[str, Any]:
        """Values for the rank-side fixtures among `sent` (the pytest side's values)."""
        if sent.keys().isdisjoint(MADE_HERE):
            return {}  # most tests: no makers to build
        makers: dict[str, Callable[[Any], Any]] = {
            "monkeypatch": lambda _: self._stack.enter_context(pytest.MonkeyPatch.context()),
            "capsys": lambda _: self._capture("SysCapture"),
            "capsysbinary": lambda _: self._capture("SysCaptureBinary"),
            "capfd": lambda _: self._capture("FDCapture"),
            "capfdbinary": lambda _: self._capture("FDCaptureBinary"),
            "caplog": lambda _: self._caplog(),
            "recwarn": lambda _: self._stack.enter_context(pytest.WarningsRecorder(_ispytest=True)),
            "request": lambda _: self._request,
            "tmp_path": self._tmp_path,
            "tmpdir": lambda base: _legacy_path(self._tmp_path(base)),
        }
        return {name: make(sent[name]) for name, make in makers.items() if name in sent}

    def close(self) -> None:
        """Undo everything made, finalizers first (the latest first), as pytest does."""
        try:
            if self._request is not None:
                self._request.run_finalizers()
        finally:
            self._stack.close()

    def _capture(self, kind: str) -> Any:
        from _pytest import capture

        request: Any = self._request  # only its config is read, by disabled()
        fixture = capture.CaptureFixture(getattr(capture, kind), request, _ispytest=True)
        fixture._start()
        self._stack.callback(fixture.close)
        return fixture

    def _caplog(self) -> Any:
        from _pytest import logging as pytest_logging

        handler = pytest_logging.LogCaptureHandler()
        holder = _StashHolder()
        holder.stash[pytest_logging.caplog_handler_key] = handler
        holder.stash[pytest_logging.caplog_records_key] = {"call": handler.records}
        self._stack.enter_context(pytest_logging.catching_logs(handler))
        fixture = pytest_logging.LogCaptureFixture(holder, _ispytest=True)  # type: ignore[arg-type]
        self._stack.callback(fixture._finalize)
        return fixture

    def _tmp_path(self, base: Any) -> Path:
        """The pytest side's tmp_path for the test, and below it one directory per rank."""
        path = Path(str(base)) / f"rank{self._rank}"
        path.mkdir(parents=True, exist_ok=True)
        return path


class _StashHolder:
    """Just enough of a node for pytest's LogCaptureFixture: a stash."""

    def __init__(self) -> None:
        self.stash = pytest.Stash()


def _legacy_path(path: Path) -> Any:
    from _pytest.compat import legacy_path

    return legacy_path(path)
