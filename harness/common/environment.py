"""The process environment, copied and set cheaply: a rank does both several times per test.

``dict(os.environ)`` decodes every variable through the mapping protocol (~100 us for 80 of
them). A :data:`Snapshot` here is a copy of the store os.environ keeps them in (bytes on
POSIX): about a microsecond. Only variables that differ are decoded, encoded or set. Imports
no torch.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any

_environ: Any = os.environ  # its store and codec are not public, but stable since Python 3.2
_HAS_STORE = isinstance(getattr(_environ, "_data", None), dict) and all(
    hasattr(_environ, name) for name in ("encodekey", "encodevalue", "decodekey", "decodevalue")
)

Snapshot = dict[Any, Any]  # variable -> value, in os.environ's own encoding


def snapshot() -> Snapshot:
    """The environment now."""
    return dict(_environ._data) if _HAS_STORE else dict(os.environ)


class _Converter:
    """Converts whole environments, converting again only the variables that changed since
    its last call: every test sends nearly the same environment."""

    def __init__(self, key: Callable[[Any], Any], value: Callable[[Any], Any]) -> None:
        self._key, self._value = key, value
        self._source: dict[Any, Any] = {}
        self._result: dict[Any, Any] = {}

    def __call__(self, source: dict[Any, Any]) -> dict[Any, Any]:
        if source == self._source:  # compared in C: the usual case between two calls
            return dict(self._result)
        result = dict(self._result)
        for name in self._source.keys() - source.keys():
            del result[self._key(name)]
        for name, value in source.items():
            if self._source.get(name) != value:
                result[self._key(name)] = self._value(value)
        self._source, self._result = dict(source), result
        return dict(result)


_encode = _Converter(_environ.encodekey, _environ.encodevalue) if _HAS_STORE else None
_decode = _Converter(_environ.decodekey, _environ.decodevalue) if _HAS_STORE else None


def encoded(variables: dict[str, str]) -> Snapshot:
    """`variables` as a snapshot, to compare with one or to restore."""
    return _encode(variables) if _encode is not None else dict(variables)


def decoded(snap: Snapshot) -> dict[str, str]:
    return _decode(snap) if _decode is not None else dict(snap)


def variables() -> dict[str, str]:
    """What dict(os.environ) gives, decoding only the variables that changed since the last
    call."""
    return decoded(snapshot())


def replaced() -> bool:
    """Whether code replaced os.environ itself (with a dict, say): what it sets there then
    reaches no subprocess."""
    return os.environ is not _environ


def put_back() -> None:
    """The real os.environ back in place, should code have replaced it."""
    if replaced():
        os.environ = _environ  # noqa: B003 - the real mapping back, not a clear


def restore(snap: Snapshot, leave: tuple[str, ...] = ()) -> None:
    """Make the environment `snap`, setting and unsetting only the variables that differ
    (os.environ.clear() alone is quadratic in their number); variables named in `leave`
    stay as they are, whatever `snap` says."""
    put_back()
    now = snapshot()
    if leave:
        snap = dict(snap)
        for name in leave:
            key = _environ.encodekey(name) if _HAS_STORE else name
            now.pop(key, None)
            snap.pop(key, None)
    if now == snap:
        return
    for key in now.keys() - snap.keys():
        del os.environ[_name(key)]
    for key, value in snap.items():
        if now.get(key) != value:
            os.environ[_name(key)] = _environ.decodevalue(value) if _HAS_STORE else value


def _name(key: Any) -> str:
    return str(_environ.decodekey(key)) if _HAS_STORE else str(key)


def _libc_environ() -> Any:
    """The C library's own `environ` array (None where it cannot be reached)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError):
        return None


_native_environ = _libc_environ()


def native() -> dict[bytes, bytes]:
    """The process's environment as the C library holds it: what a child process inherits.
    os.putenv and native code (a C extension's setenv) change it without os.environ
    knowing. Empty where it cannot be read."""
    found: dict[bytes, bytes] = {}
    if _native_environ is None:
        return found
    i = 0
    while (entry := _native_environ[i]) is not None:
        name, _, value = entry.partition(b"=")
        found[name] = value
        i += 1
    return found


def changed_natively(before: dict[bytes, bytes], skip: tuple[str, ...] = ()) -> list[str]:
    """The variables whose value in the C library's environment differs from `before`, but
    not in os.environ's (set or unset by os.putenv/os.unsetenv or native code); names
    starting with one of `skip` are not counted."""
    return sorted(k.decode(errors="replace") for k in _changed_natively(before, skip))


def restore_native(before: dict[bytes, bytes], skip: tuple[str, ...] = ()) -> None:
    """Set the C library's environment back to `before` where it differs and os.environ does
    not say otherwise (names starting with one of `skip` are left as they are)."""
    for key, value in _changed_natively(before, skip).items():
        if value is None:
            os.unsetenv(key)
        else:
            os.putenv(key, value)


def _changed_natively(
    before: dict[bytes, bytes], skip: tuple[str, ...]
) -> dict[bytes, bytes | None]:
    """Each variable changed outside os.environ since `before`, with its value then (None:
    it was not set); names starting with one of `skip` left out."""
    now, python_view = native(), _as_bytes()
    changed: dict[bytes, bytes | None] = {}
    for key in before.keys() | now.keys():
        value = now.get(key)
        if value == before.get(key) or python_view.get(key) == value:
            continue
        if not key.decode(errors="replace").startswith(skip):
            changed[key] = before.get(key)
    return changed


def _as_bytes() -> dict[bytes, bytes]:
    """os.environ, as bytes (the encoding its store already has on POSIX)."""
    if _HAS_STORE and all(isinstance(k, bytes) for k in _environ._data):
        return dict(_environ._data)
    return {
        k.encode(errors="surrogateescape"): v.encode(errors="surrogateescape")
        for k, v in os.environ.items()
    }
