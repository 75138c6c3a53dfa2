"""A rank test's log records, captured in the rank as pytest captures a plain test's.

pytest's logging plugin attaches a handler to the root logger (and to every logger that does
not propagate) around each test phase, at the session's log_level and in its log_format; the
report then shows what it caught under "Captured log". A rank does the same around the test
(its rank-made fixtures included), writing each record to the rank's log file as it comes,
so the records of a rank that then hangs or dies are kept; the pytest side reads the file's
tail, as it reads the rank's streams, and adds one such section per rank. Runs inside ranks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from harness.protocol import LogCapture

_file: TextIO | None = None  # the rank's log file (RankFiles.log), opened once
_handler: logging.StreamHandler[Any] | None = None


def use_file(path: Path) -> None:
    """Write captured records to `path` (the rank's log file, which the pytest side reads)."""
    global _file, _handler
    _file = open(path, "w", encoding="utf-8", errors="replace")  # noqa: SIM115 - the rank's
    _handler = logging.StreamHandler(_file)  # it flushes each record: nothing waits in memory


def empty() -> None:
    """Empty the log file for the next run (already empty unless the last run logged)."""
    if _file is not None and _file.tell():
        _file.seek(0)
        _file.truncate()


@contextlib.contextmanager
def capturing(settings: LogCapture | None) -> Iterator[None]:
    """Capture log records into the rank's log file while inside; nothing is captured when
    `settings` is None (records then go where logging sends them)."""
    if settings is None or _handler is None:
        yield
        return
    from _pytest import logging as pytest_logging

    _handler.setFormatter(_formatter(settings))
    _handler.setLevel(settings.level or logging.NOTSET)
    with pytest_logging.catching_logs(_handler, level=settings.level):
        yield


@functools.lru_cache(maxsize=4)
def _formatter(settings: LogCapture) -> Any:
    """pytest's report formatter, less colour (a rank has no terminal to ask); one per
    session's settings, as pytest shares one."""
    from _pytest import logging as pytest_logging

    formatter = pytest_logging.DatetimeFormatter(settings.fmt, settings.datefmt)
    formatter._style = pytest_logging.PercentStyleMultiline(
        formatter._style._fmt, auto_indent=settings.auto_indent
    )
    return formatter
