"""How long the pytest process waits for new ranks to say they are ready.

The bound is on time without progress, not on time: a rank still using CPU (importing
torch under spawn on a busy runner, or slowed by a machine that stalled) is given more,
up to a cap; one that sleeps (a deadlock, a lock a fork inherited) is cut at the bound.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

# A rank that has used no CPU for this long is stuck, however busy the machine is.
NO_PROGRESS_S = 120.0
# However busy it is, no pool takes longer than this to start.
START_CAP_S = 600.0
# How often the pytest process looks, between a rank's messages.
CHECK_S = 1.0

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_STATES = {"R": "running", "S": "sleeping", "D": "waiting on the disk", "Z": "ended"}


def cpu_and_state(pid: int) -> tuple[float, str]:
    """CPU seconds `pid` has used and its state letter, from /proc; (0.0, "") without it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS, fields[0]
    except (OSError, IndexError, ValueError):
        return 0.0, ""


class StartWatch:
    """Whether ranks being started still make progress: CPU used by any of them since the
    last look moves the no-progress deadline."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[int], tuple[float, str]] = cpu_and_state,
    ) -> None:
        self._clock, self._read = clock, read
        self._began = self._progressed = clock()
        self._cpu: dict[int, float] = {}

    def expired(self, pending: Iterable[int]) -> bool:
        """Whether to give up on `pending` (the pids not ready yet)."""
        now = self._clock()
        for pid in pending:
            used, _ = self._read(pid)
            if used > self._cpu.get(pid, 0.0):
                self._cpu[pid] = used
                self._progressed = now
        return now - self._progressed >= NO_PROGRESS_S or now - self._began >= START_CAP_S

    def account(self, pid: int) -> str:
        """Why `pid` was given up on, with what /proc says of it."""
        now = self._clock()
        used, state = self._read(pid)
        seen = f"pid {pid}, {_STATES.get(state, state or 'state unknown')}, {used:.2f} s of CPU"
        if now - self._began >= START_CAP_S:
            return f"still starting after {START_CAP_S:.0f} s, the most a pool may take ({seen})"
        return (
            f"no progress for {NO_PROGRESS_S:.0f} s ({seen}; "
            f"{now - self._began:.0f} s since it was started)"
        )
