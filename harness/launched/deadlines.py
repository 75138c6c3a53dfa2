"""One thread keeps every test's bound on a launched rank.

A thread started for each test's bound cost the test a thread's start (its caller waits for
the new thread to run: on a busy machine, a wait for a core). Here a block registers its
deadline as it starts and withdraws it as it ends; one thread sleeps until the earliest (or
10 s, with nothing due), and is woken only for a deadline earlier than that. A
deadline that passes is handed to its callback on a thread of its own, started then (rare):
a callback that blocks does not hold back the others.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

# With nothing due, the thread still wakes this often: a test's deadline later than that is
# added without waking it (nearly every test's: bounds are a minute or more).
_IDLE_WAKE_S = 10.0


class Deadlines:
    """Deadlines with a callback each; a withdrawn one never fires."""

    def __init__(self, thread_name: str = "harness-deadlines") -> None:
        self._changed = threading.Condition()
        self._due: dict[int, tuple[float, Callable[[], None], str]] = {}
        self._ids = itertools.count()
        self._name = thread_name
        self._thread: threading.Thread | None = None
        self._wakes_at = 0.0  # when the thread wakes next (time.monotonic())

    def add(self, seconds: float, expired: Callable[[], None], name: str) -> int:
        """Call `expired` (on a thread named `name`) once `seconds` pass, unless withdrawn
        first; the token to withdraw it with."""
        with self._changed:
            if self._thread is None:
                self._thread = threading.Thread(target=self._keep, name=self._name, daemon=True)
                self._thread.start()
            token = next(self._ids)
            deadline = time.monotonic() + seconds
            self._due[token] = (deadline, expired, name)
            if deadline < self._wakes_at:  # else the thread is up in time: no wake-up (a
                self._changed.notify()  # wake-up is a thread switch, for every test)
            return token

    def withdraw(self, token: int) -> None:
        """The block ended in time: its callback never runs (the thread's next wake-up finds
        nothing due and sleeps again)."""
        with self._changed:
            self._due.pop(token, None)

    def _keep(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                for token, (deadline, expired, name) in list(self._due.items()):
                    if deadline <= now:
                        del self._due[token]
                        threading.Thread(target=expired, name=name, daemon=True).start()
                idle = now + _IDLE_WAKE_S
                self._wakes_at = min((due[0] for due in self._due.values()), default=idle)
                self._changed.wait(max(0.0, self._wakes_at - now))
