"""A rank test's log records, captured in the rank as pytest captures a plain test's.

pytest's logging plugin attaches a handler to the root logger (and to every logger that does
not propagate) around each test phase, at the session's log_level and in its log_format; the
report then shows what it caught under "Captured log". A rank does the same around the test
(its rank-made fixtures included), writing each record to the rank's log file as it comes,
so the records of a rank that then hangs or dies are kept; the pytest side reads the file's
tail, as it reads the rank's streams, and adds one such section per rank.

Attaching a handler to torch's forty-odd loggers and taking it off again, under logging's
lock, was a third of a warm rank's work per trivial test. So the handler stays attached from
test to test: each test only attaches it where it is missing (a new logger that does not
propagate, one a test cleared) and takes it off a logger that propagates again (a record
would be written twice). Between tests it acts as if it were not there. Runs inside ranks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from harness.common import pytest_internals
from harness.common.protocol import LogCapture

# torch.distributed logs every collective's error to loggers it gives a NullHandler (meant
# for no one): in a rank test each peer's copy of a transport error would show in its log.
_TORCH_QUIET = "c10d-NullHandler"


class _RankLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes records to the rank's log file while a test is captured."""

    capturing = False

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        # The record last seen between tests, by thread: a logger left with this handler
        # that propagates again hands the same record to it twice on its way to the root.
        self._seen = threading.local()

    def handle(self, record: logging.LogRecord) -> bool:
        if self.capturing:
            if record.name.startswith(_TORCH_QUIET):
                return False  # torch's own debug lines for a NullHandler: a peer's error again
            return super().handle(record)
        if getattr(self._seen, "record", None) is not record:
            self._seen.record = record
            _as_if_absent(record)
        return False


_file: TextIO | None = None  # the rank's log file (RankFiles.log), opened once
_handler: _RankLogHandler | None = None
_attached: list[logging.Logger] = []  # the loggers the handler is attached to


def use_file(path: Path) -> None:
    """Write captured records to `path` (the rank's log file, which the pytest side reads)."""
    global _file, _handler
    _file = open(path, "w", encoding="utf-8", errors="replace")  # noqa: SIM115 - the rank's
    _handler = _RankLogHandler(_file)  # it flushes each record: nothing waits in memory


def empty() -> None:
    """Empty the log file for the next run (already empty unless the last run logged)."""
    if _file is not None and _file.tell():
        _file.seek(0)
        _file.truncate()


@contextlib.contextmanager
def capturing(settings: LogCapture | None) -> Iterator[None]:
    """Capture log records into the rank's log file while inside; nothing is captured when
    `settings` is None (records then go where logging sends them)."""
    handler = _handler
    if settings is None or handler is None:
        yield
        return
    handler.setFormatter(_formatter(settings))
    handler.setLevel(settings.level or logging.NOTSET)
    _attach(handler)
    root = logging.getLogger()
    root_level = root.level
    if settings.level is not None:  # loggers that do not set theirs inherit it, as in pytest
        root.setLevel(min(root_level, settings.level))
    handler.capturing = True
    try:
        yield
    finally:
        handler.capturing = False
        handler.setLevel(logging.NOTSET)  # between tests every record reaches _as_if_absent
        if settings.level is not None:
            root.setLevel(root_level)


def _attach(handler: logging.Handler) -> None:
    """Attach `handler` where pytest's would be: the root logger and every logger that does
    not propagate; off any other it is on."""
    global _attached
    root = logging.getLogger()
    loggers: Any = root.manager.loggerDict.values()
    wanted: list[logging.Logger] = [root] + [
        logger  # a placeholder (a name only) has no propagate: it propagates
        for logger in loggers
        if getattr(logger, "propagate", True) is False
    ]
    for logger in wanted:
        if handler not in logger.handlers:  # a new logger, or one a test cleared
            logger.addHandler(handler)
    if wanted != _attached:  # loggers compare by identity
        keep = {id(logger) for logger in wanted}
        for logger in _attached:
            if id(logger) not in keep:
                logger.removeHandler(handler)
        _attached = wanted


def _as_if_absent(record: logging.LogRecord) -> None:
    """What logging does with `record` when no handler of ours is attached: if no other
    handler is found on the logger's way to the root, its last resort writes it to stderr."""
    logger: Any = logging.getLogger() if record.name == "root" else logging.getLogger(record.name)
    while logger is not None:
        if any(not isinstance(h, _RankLogHandler) for h in logger.handlers):
            return
        logger = logger.parent if logger.propagate else None
    last_resort = logging.lastResort
    if last_resort is not None and record.levelno >= last_resort.level:
        last_resort.handle(record)


@functools.lru_cache(maxsize=4)
def _formatter(settings: LogCapture) -> Any:
    """pytest's report formatter, less colour (a rank has no terminal to ask); one per
    session's settings, as pytest shares one."""
    pytest_logging = pytest_internals.logging_plugin()
    formatter = pytest_logging.DatetimeFormatter(settings.fmt, settings.datefmt)
    formatter._style = pytest_logging.PercentStyleMultiline(
        formatter._style._fmt, auto_indent=settings.auto_indent
    )
    return formatter
