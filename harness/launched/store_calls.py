"""Store calls with a bound: a call the store does not answer in time fails instead of hanging.

torch's store client has no bound of its own on a call in flight: through a cut link, or to a
frozen node, it waits until TCP gives up (about 15 minutes), its timeout notwithstanding.
Each call runs on its caller's thread (a hand-off to a thread of its own cost every call two
thread switches, a millisecond a test on a busy machine), and a watchdog thread shuts the
client's connection down under a call unanswered for its bound: torch's call then fails at
once, and so does every later one. Where the client's connection cannot be found (no /proc),
each call runs on a thread of its own instead and is left behind there at its bound.

torch's C++ warning for a failed call is held back (quiet_cpp): the caller gets the error.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from harness.launched import quiet_cpp

_WATCH_EVERY_S = 0.25  # how often the watchdog looks at the calls in flight


class StoreCalls:
    """Bounded store calls on one client; `connection` is the client's socket descriptor
    (None: calls are handed to a thread of their own)."""

    def __init__(self, connection: int | None) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._deadlines: dict[int, float] = {}  # calls in flight: when each one's bound ends
        self._expired: set[int] = set()  # calls the watchdog cut the connection under
        self._cut = False
        self._handed: _HandedCalls | None = None
        if connection is None:
            self._handed = _HandedCalls()
        else:  # the watchdog holds this object weakly: it ends once the client is dropped
            watch = threading.Thread(
                target=_watch, args=(weakref.ref(self),), name="harness-store-watch", daemon=True
            )
            watch.start()

    def run(self, operation: Callable[[], Any], bound_s: float) -> tuple[bool, Any]:
        """(answered within `bound_s`, the result or the exception it raised)."""
        if self._handed is not None:
            return self._handed.run(operation, bound_s)
        with self._lock:
            call = next(self._ids)
            self._deadlines[call] = time.monotonic() + bound_s
        try:
            with quiet_cpp.quiet():  # a failure is raised to the caller, not logged
                result = operation()
        except BaseException as exc:  # handed to the caller, who decides
            result = exc
        with self._lock:
            del self._deadlines[call]
            expired = call in self._expired
            self._expired.discard(call)
        return (False, None) if expired else (True, result)

    def look(self) -> bool:
        """Cut the connection under any call past its bound; whether to look again."""
        now = time.monotonic()
        with self._lock:
            late = {call for call, deadline in self._deadlines.items() if deadline <= now}
            self._expired |= late
        if late:
            self._cut_connection()
        return not self._cut

    def _cut_connection(self) -> None:
        """Shut the client's connection down: the late call and every later one fail."""
        assert self._connection is not None
        self._cut = True
        with contextlib.suppress(OSError):
            peer = socket.socket(fileno=os.dup(self._connection))
            try:
                peer.shutdown(socket.SHUT_RDWR)
            finally:
                peer.close()


def _watch(calls: weakref.ref[StoreCalls]) -> None:
    """The watchdog's loop, until the connection is cut or its StoreCalls is gone."""
    while True:
        time.sleep(_WATCH_EVERY_S)
        watched = calls()
        if watched is None or not watched.look():
            return
        del watched  # held only while it looks


class _HandedCalls:
    """Each call run on a thread of its own, waited for at most its bound: one that blocks is
    left behind there, and its caller goes on. torch's client releases the GIL while it waits
    on its socket, so the caller's wait is its own."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, list[Any]]] = (
            queue.SimpleQueue()
        )
        self._one_caller = threading.Lock()
        threading.Thread(target=self._serve, name="harness-store", daemon=True).start()

    def run(self, operation: Callable[[], Any], bound_s: float) -> tuple[bool, Any]:
        with self._one_caller:
            done = threading.Event()
            box: list[Any] = []
            self._todo.put((operation, done, box))
            if not done.wait(bound_s):
                quiet_cpp.release()  # the call left behind holds back no one's warnings
                return False, None
            return True, box[0]

    def _serve(self) -> None:
        while True:
            operation, done, box = self._todo.get()
            try:
                with quiet_cpp.quiet():
                    box.append(operation())
            except BaseException as exc:
                box.append(exc)
            done.set()


def socket_descriptors() -> set[int]:
    """This process's open socket descriptors (empty where /proc cannot tell)."""
    found = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    found.add(int(name))
    return found


def connection_to(port: int, among: set[int]) -> int | None:
    """The one descriptor in `among` connected to `port` (a store client's connection to its
    server); None where there is not exactly one."""
    found = [fd for fd in among if _peer_port(fd) == port]
    return found[0] if len(found) == 1 else None


def _peer_port(fd: int) -> int | None:
    """The port `fd`'s TCP connection reaches; None for any other descriptor."""
    with contextlib.suppress(OSError):
        peer = socket.socket(fileno=os.dup(fd))
        try:
            if peer.family in (socket.AF_INET, socket.AF_INET6):
                return int(peer.getpeername()[1])
        finally:
            peer.close()
    return None
