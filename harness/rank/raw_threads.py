"""Threads a test starts with `_thread` directly, as C extensions' Python wrappers do:
`threading.enumerate()` never lists them and they cannot be joined, and one left blocked in a
collective joins the next test's. The rank wraps `_thread.start_new_thread` (threading keeps
its own reference, so its threads never pass here) and keeps each such thread's function
until it returns: a thread just started, not yet running, counts too.
"""

from __future__ import annotations

import _thread
import itertools
from collections.abc import Callable
from typing import Any

_running: dict[int, str] = {}  # serial -> the function each live raw thread runs, in words
_serials = itertools.count()
_original: Any = _thread.start_new_thread


def track() -> None:
    """Wrap `_thread.start_new_thread` (and its old alias) in this process; once."""
    if getattr(_thread.start_new_thread, "_harness_tracks", False):
        return
    _thread.start_new_thread = _tracked
    if hasattr(_thread, "start_new"):
        _thread.start_new = _tracked


def running() -> dict[int, str]:
    """The raw threads running now (or about to), by serial: their functions, in words."""
    return dict(_running)


def _tracked(function: Callable[..., Any], args: tuple[Any, ...], kwargs: Any = None) -> int:
    serial = next(_serials)
    code = getattr(function, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    _running[serial] = f"{getattr(function, '__qualname__', repr(function))}{where}"

    def run(*a: Any, **k: Any) -> Any:
        try:
            return function(*a, **k)
        finally:
            _running.pop(serial, None)

    try:
        ident: int = _original(run, args, kwargs or {})
    except BaseException:
        _running.pop(serial, None)
        raise
    return ident


_tracked._harness_tracks = True  # type: ignore[attr-defined]
