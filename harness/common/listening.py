"""Waiting, bounded, until a TCP listener takes a connection, with a plain socket: torch's
store client, refused, logs each try with C++ frames (a cut link, a store not up yet) and
pauses about half a second before the next; a plain socket's tries say nothing and come as
often as asked. A launched rank waits so for the launch's store, a warm rank's own TCPStore
client (a test's env:// group) for its host. Imports neither side, nor torch.
"""

from __future__ import annotations

import socket
import time

_LONGEST_TRY_S = 5.0  # one try's own connect timeout, at most


def await_listening(
    host: str,
    port: int,
    bound_s: float,
    *,
    first_pause_s: float,
    last_pause_s: float,
    try_at_least_s: float,
) -> OSError | None:
    """None once `host`:`port` takes a connection; else, once `bound_s` has passed, the last
    try's error. Each pause between tries is twice the last, from `first_pause_s` up to
    `last_pause_s`; each try waits at least `try_at_least_s` for its connection."""
    deadline = time.monotonic() + bound_s
    pause = first_pause_s
    while True:
        left = deadline - time.monotonic()
        try:
            timeout = max(try_at_least_s, min(_LONGEST_TRY_S, left))
            with socket.create_connection((host, port), timeout=timeout):
                return None
        except OSError as exc:
            if time.monotonic() >= deadline:
                return exc
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, last_pause_s)
