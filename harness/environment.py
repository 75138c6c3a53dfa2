"""The process environment, copied and set cheaply: a rank does both several times per test.

``dict(os.environ)`` decodes every variable through the mapping protocol (~100 us for 80 of
them). A :data:`Snapshot` here is a copy of the store os.environ keeps them in (bytes on
POSIX): about a microsecond. Only variables that differ are decoded, encoded or set. Imports
no torch.
"""

from __future__ import annotations

import os
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
