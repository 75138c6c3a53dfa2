"""A test's own TCPStore rendezvous on a warm rank (``env://`` or ``tcp://``, as DeepSpeed's
tests and torchrun-style code set their groups up): a rank that tries to connect before the
host rank listens is refused, and torch's client then pauses about half a second before it
tries again. The ranks of a warm world start a test together, so one test in a few lost that
race. Here a client first waits until the host takes a connection, trying a plain socket
every millisecond or so at first (it says nothing), then connects at once. That wait lasts a
few seconds at most: a host later than that is left to torch's client and its own timeout,
so a host that never comes fails as it would without the harness, barely later. Runs inside
warm ranks; installed once per rank process.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

from harness.common import listening

_FIRST_PAUSE_S = 0.001
_LAST_PAUSE_S = 0.05
_DEFAULT_TIMEOUT_S = 300.0  # TCPStore's own default
_AWAIT_AT_MOST_S = 5.0  # a race lost by more than this is rare: torch's client takes it over
_ARGS = ("host_name", "port", "world_size", "is_master", "timeout")


def connect_when_listening() -> None:
    """Make torch's rendezvous (init_process_group's env:// and tcp://) create each store
    client once its host listens."""
    rendezvous: Any = importlib.import_module("torch.distributed.rendezvous")  # not the function
    original = getattr(rendezvous, "TCPStore", None)
    if original is None or getattr(original, "_harness_waits", False):
        return

    def tcp_store(*args: Any, **kwargs: Any) -> Any:
        given = dict(zip(_ARGS, args, strict=False)) | kwargs
        if not given.get("is_master", False) and "host_name" in given and "port" in given:
            listening.await_listening(  # past its bound, torch's client reports its own error
                str(given["host_name"]), int(given["port"]),
                min(_seconds(given), _AWAIT_AT_MOST_S),
                first_pause_s=_FIRST_PAUSE_S, last_pause_s=_LAST_PAUSE_S, try_at_least_s=0.1,
            )  # fmt: skip
        return original(*args, **kwargs)

    tcp_store._harness_waits = True  # type: ignore[attr-defined]
    rendezvous.TCPStore = tcp_store


def _seconds(given: dict[str, Any]) -> float:
    timeout = given.get("timeout")
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return _DEFAULT_TIMEOUT_S
