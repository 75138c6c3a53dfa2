"""Python stacks of hung ranks, taken with faulthandler (which works inside C++ calls too)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

STACK_DUMP_WAIT_S = 3.0
_POLL_S = 0.05


def dump_stacks(ranks: dict[int, tuple[int, Path]]) -> dict[int, str]:
    """Signal each rank ({rank: (pid, stack file)}) to dump its stacks; return them trimmed."""
    for pid, path in ranks.values():
        with contextlib.suppress(OSError):
            path.write_bytes(b"")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    _await_dumps([path for _, path in ranks.values()])
    return {rank: trim_stack(_read(path)) for rank, (_, path) in ranks.items()}


def _await_dumps(paths: list[Path]) -> None:
    """Wait, bounded, until every dump is non-empty and has stopped growing.

    faulthandler writes no end marker, so "stopped growing between two polls" is the signal.
    """
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    last: list[int] = []
    while time.monotonic() < deadline:
        sizes = [_size(p) for p in paths]
        if sizes == last and all(sizes):
            return
        last = sizes
        time.sleep(_POLL_S)


def trim_stack(text: str) -> str:
    """Drop the harness's and multiprocessing's frames below the user's code in each thread."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        if not line.startswith("  File "):
            skipping = False
            kept.append(line)
        elif skipping or "/harness/worker.py" in line:
            skipping = True
        else:
            kept.append(line)
    return "\n".join(kept)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
