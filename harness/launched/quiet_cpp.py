"""torch's C++ warnings held back while one of the harness's own store calls runs.

torch logs every failed store call as a C++ warning with its frames, straight to the
process's stderr, before it raises. The harness turns that error into its verdict (the node
that held the store, lost), so the warning says nothing new; and where the call comes
between tests, outside pytest's capture, its frames land uncut in the rank's log. While a
harness call runs, c10's log level is raised to errors only; it is put back as the call
returns, or as its caller stops waiting for it (a call left blocked on a cut link must not
hold back other warnings for as long as TCP takes to give up). A C++ warning another thread
prints meanwhile (microseconds; a wait at an exchange, up to a quarter second a slice) is not
shown either: docs/limits.md says so.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

_ERRORS_ONLY = 2  # c10's levels: 0 info, 1 warning, 2 error, 3 fatal

_lock = threading.Lock()
_held = 0  # calls running with the level raised
_saved = 0  # the level before the first of them
_generation = 0  # bumped by release(): a call left behind then restores nothing


@functools.cache
def _flag_once() -> ctypes.c_int | None:
    """c10's log level (FLAGS_caffe2_log_level in libc10), or None in a build without it;
    looked up once."""
    try:
        import torch

        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        return ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError, AttributeError):
        return None


class quiet:  # a context manager, named as contextlib's are
    """Run the block with c10's log level at errors only (nested and threaded blocks share
    one raise: the level is put back when the last one ends). A class, not a generator: it
    wraps every store call."""

    __slots__ = ("_generation",)

    def __enter__(self) -> None:
        self._generation = _enter()

    def __exit__(self, *exc: object) -> None:
        _leave(self._generation)


def release() -> None:
    """Put the level back now, whatever still runs under `quiet` (their ends change nothing)."""
    global _held, _generation
    with _lock:
        if _held and (flag := _flag_once()) is not None:
            flag.value = _saved
        _held, _generation = 0, _generation + 1


def _enter() -> int:
    global _held, _saved
    with _lock:
        flag = _flag_once()
        if flag is not None and _held == 0:
            _saved = flag.value
            flag.value = max(_saved, _ERRORS_ONLY)
        _held += 1
        return _generation


def _leave(generation: int) -> None:
    global _held
    with _lock:
        if generation != _generation:
            return
        _held -= 1
        if _held == 0 and (flag := _flag_once()) is not None:
            flag.value = _saved
