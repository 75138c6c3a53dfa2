"""The store warm ranks meet through: a file in the session's private work directory.

A TCPStore on a port answers any local process: it lists its keys' names to whoever asks
and takes their writes, so another user could read a run's keys and forge the next runs'.
A file below the session's 0700 work directory is the session user's alone. torch's
FileStore polls every 10 ms while it waits (and a fresh group's set-up waits several times),
so the waits here poll it from Python: briefly at first, as ranks usually arrive together.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

_FIRST_POLL_S = 0.0001
_LAST_POLL_S = 0.005
_DEFAULT_TIMEOUT = timedelta(minutes=5)


class PrivateStore(dist.Store):  # type: ignore[misc,name-defined]
    """A store on the file at `path` (in a directory only this user can enter)."""

    def __init__(self, path: str, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self.path = path
        self._file = dist.FileStore(path, -1)  # type: ignore[attr-defined]  # -1: never removed
        self.set_timeout(timeout)
        self._pause = threading.Event()  # never set: a bounded pause between polls

    def set(self, key: str, value: bytes | str) -> None:
        self._file.set(key, value)  # type: ignore[arg-type]  # bytes too

    def get(self, key: str) -> bytes:
        self.wait([key])
        value: bytes = self._file.get(key)
        return value

    def add(self, key: str, amount: int) -> int:
        total: int = self._file.add(key, amount)
        return total

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        value: bytes = self._file.compare_set(key, expected, desired)  # type: ignore[arg-type]
        return value

    def check(self, keys: list[str]) -> bool:
        return bool(self._file.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._file.delete_key(key))

    def num_keys(self) -> int:
        return int(self._file.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        # The base's own field is what torch reads (a PrefixStore over this one sets it too).
        super().set_timeout(timeout)
        self._file.set_timeout(timeout)

    def clone(self) -> PrivateStore:
        return PrivateStore(self.path, self.timeout)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key is set; raise DistStoreError after `timeout` (the store's)."""
        bound = (self.timeout if timeout is None else timeout).total_seconds()
        start = time.monotonic()
        pause = _FIRST_POLL_S
        while not self._file.check(keys):
            waited = time.monotonic() - start
            if waited >= bound:
                raise dist.DistStoreError(
                    f"timed out after {waited:.3g} s waiting for keys {keys} in the store at "
                    f"{self.path}"
                )
            self._pause.wait(pause)
            pause = min(pause * 2, _LAST_POLL_S)
