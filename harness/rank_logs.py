"""A rank test's log records, captured in the rank as pytest captures a plain test's.

pytest's logging plugin attaches a handler to the root logger (and to every logger that does
not propagate) around each test phase, at the session's log_level and in its log_format; the
report then shows what it caught under "Captured log". A rank does the same around the test
(its rank-made fixtures included), and the pytest side adds one such section per rank.
Runs inside ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from harness.protocol import OUTPUT_LIMIT, LogCapture


@contextlib.contextmanager
def capturing(settings: LogCapture | None) -> Iterator[Callable[[], str]]:
    """Capture log records while inside; yields a function returning their formatted text
    (always "" when `settings` is None: records then go where logging sends them)."""
    if settings is None:
        yield str
        return
    from _pytest import logging as pytest_logging

    handler = pytest_logging.LogCaptureHandler()
    handler.setFormatter(_formatter(settings))
    with pytest_logging.catching_logs(handler, level=settings.level):
        yield lambda: _tail(handler.stream.getvalue().strip())


def _tail(text: str) -> str:
    """The last OUTPUT_LIMIT characters, as a rank's streams keep theirs."""
    if len(text) <= OUTPUT_LIMIT:
        return text
    return f"[... {len(text) - OUTPUT_LIMIT} characters cut ...]\n{text[-OUTPUT_LIMIT:]}"


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
