"""The shared-memory buffers DeepSpeed's CPU all-reduce leaves behind, removed after each run.

DeepSpeed's shm op (csrc/cpu/comm/shm.cpp) gives each rank a 66 MB POSIX shared-memory buffer
named ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` the first time
the process sets up a group, and never unlinks it: it lives in /dev/shm (memory) until the
machine restarts. As they are, DeepSpeed's tests reuse a few ports, so a few buffers are
rewritten; warm ranks run each test on a port of its own, so each new rank process would
leave one more. The names are removed once the test's ranks have returned: every rank has
mapped its peers' buffers by then, and a mapping outlives its name; and when a signal ends the
session mid-test (a cancelled CI job), with its ranks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"

_in_use: set[str] = set()  # the ports of the runs going on now


@contextlib.contextmanager
def buffers_removed_after(port: str) -> Iterator[None]:
    """Run with MASTER_PORT `port`; its buffers are removed after, or by remove_in_use."""
    _in_use.add(port)
    try:
        yield
    finally:
        remove_deepspeed_buffers(port)
        _in_use.discard(port)


def remove_in_use() -> None:
    """The buffers of the runs going on now (the session is being ended by a signal)."""
    for port in list(_in_use):
        remove_deepspeed_buffers(port)


def deepspeed_buffers(port: str) -> list[Path]:
    """This user's DeepSpeed all-reduce buffers named after `port` (any address, any rank)."""
    if not SHM_DIR.is_dir() or not hasattr(os, "getuid"):
        return []
    found = []
    for path in SHM_DIR.glob(f"{PREFIX}_{os.getuid()}_*_{port}_*"):
        rank = path.name.rsplit("_", 1)[1]
        if rank.isdigit() and path.name.rsplit("_", 2)[1] == port:
            found.append(path)
    return found


def remove_deepspeed_buffers(port: str) -> None:
    """Unlink the buffers named after `port` (they are this user's: the name holds the uid,
    and /dev/shm lets no one unlink another user's file)."""
    for path in deepspeed_buffers(port):
        with contextlib.suppress(OSError):
            if path.stat().st_uid == os.getuid():
                path.unlink()
