"""Python stacks of hung ranks, taken with faulthandler (which works inside C++ calls too)."""

from __future__ import annotations

import contextlib
import importlib.util
import linecache
import os
import re
import time
from functools import cache
from pathlib import Path

from harness.common import reaper
from harness.common.protocol import DUMP_STACKS_SIGNAL
from harness.common.report_text import fold_runs

STACK_DUMP_WAIT_S = 3.0
_POLL_S = 0.05


def dump_stacks(ranks: dict[int, tuple[int, Path]]) -> dict[int, str]:
    """Signal each rank ({rank: (pid, stack file)}) to dump its stacks; return them trimmed,
    each followed by the stacks of the copies of it the test forked (a rank waiting on its
    child shows little but the wait: the child is where it hangs)."""
    for pid, path in ranks.values():
        with contextlib.suppress(OSError):
            path.write_bytes(b"")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, DUMP_STACKS_SIGNAL)
    _await_dumps([path for _, path in ranks.values()])
    found = {rank: trim_stack(_read(path)) for rank, (_, path) in ranks.items()}
    for rank, (pid, path) in ranks.items():
        found[rank] += _forked_copies_stacks(pid, path)
    return found


FORKED_COPIES_SHOWN = 8


def _forked_copies_stacks(pid: int, path: Path) -> str:
    """The stacks of the processes below rank `pid` that are forks of it (the same command
    line: they inherited its stack dump, which writes to `path`), one after the other."""
    texts = []
    for child in _forked_copies(pid)[:FORKED_COPIES_SHOWN]:
        with contextlib.suppress(OSError):
            path.write_bytes(b"")
        try:
            os.kill(child, DUMP_STACKS_SIGNAL)
        except ProcessLookupError:
            continue
        _await_dumps([path])
        stack = trim_stack(_read(path))
        if stack.strip():
            texts.append(f"\n-- a process this rank forked (pid {child}) --\n{stack}")
    return "".join(texts)


def _forked_copies(pid: int) -> list[int]:
    own = _cmdline(pid)
    if not own:
        return []
    return [child for child in reaper.descendants(pid) if _cmdline(child) == own]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


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


CRASH_SHOWN = 64 * 1024  # bytes of a crash's dump read: a deep recursion's stops at 100 frames


def crash_stack(path: Path) -> str:
    """What faulthandler wrote on a rank's fatal signal (the crashing thread's stack, down
    to the test's frames, each with its source line); empty if the rank wrote none."""
    try:
        with open(path, "rb") as f:
            text = f.read(CRASH_SHOWN).decode(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if not line.startswith("Extension modules:")]
    return trim_stack("\n".join(lines)).strip()


def trim_stack(text: str) -> str:
    """Drop the harness's and multiprocessing's frames below the user's code in each thread."""
    kept: list[str] = []
    skipping = False
    harness_frames = tuple(f'File "{file}"' for file in _rank_files())
    for line in text.splitlines():
        if not line.startswith("  File "):
            skipping = False
            kept.append(line)
        elif skipping or any(frame in line for frame in harness_frames):
            skipping = True
        else:
            kept += [line, *_source_of(line)]
    return "\n".join(kept)


def trim_in_process(text: str, caller: str, quiet: tuple[str, ...]) -> str:
    """A dump taken inside a launched pytest process, trimmed to the test's own frames.

    Frames below `caller`'s file (the harness calling the body; pytest and pluggy beneath it;
    with no such frame, below the first of pytest's own, as for a fixture) are dropped, and
    so are the dumping thread and threads idle in `quiet` files (the harness's own watchers).
    """
    kept: list[str] = []
    for section in re.split(r"\n(?=\S)", text.strip()):
        header, *frames = section.splitlines()
        if header.startswith("Current thread"):
            continue  # the timer that took the dump
        files = [m[1] for f in frames if (m := _FRAME.match(f))]
        if files and all(f.endswith(quiet) or "/threading.py" in f for f in files):
            continue
        lines = [header]
        called = any(f'File "{caller}"' in frame for frame in frames)
        for frame in frames:
            if f'File "{caller}"' in frame or (not called and _PYTEST_FRAME in frame):
                break  # the harness's call of the body: what is below is pytest's
            lines += [frame, *_source_of(frame)]
        kept.append("\n".join(lines))
    return "\n\n".join(kept)


_PYTEST_FRAME = f"{os.sep}_pytest{os.sep}"
_FRAME = re.compile(r'  File "(.+)", line (\d+) in ')


def _source_of(frame_line: str) -> list[str]:
    """The frame's source line, indented under it as a traceback shows it (none if unknown)."""
    match = _FRAME.match(frame_line)
    source = linecache.getline(match[1], int(match[2])).strip() if match else ""
    return [f"    {source}"] if source else []


# The rank's own modules between its entry point and the test's code (in the order they call).
_RANK_CALLERS = (
    "harness.rank.entry",
    "harness.rank.worker",
    "harness.rank.task",
    "harness.rank.body",
    "harness.rank.loader",
    "harness.rank.group",
    "harness.adopt.ranks",  # the entry every adopted base's rank goes through
)


@cache
def _rank_files() -> tuple[str, ...]:
    """The files of the rank's modules that call the test, found without importing them
    (they import torch)."""
    found = []
    for name in _RANK_CALLERS:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        found.append(spec.origin)
    return tuple(found)


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


_IMPORTLIB = re.compile(r'  File "<frozen importlib\._bootstrap(_external)?>"')


def fold_importlib(text: str) -> str:
    """A stack dump with each run of importlib's own frames folded into one line."""
    return "\n".join(fold_runs(text.splitlines(), _IMPORTLIB, "  [{} importlib frame(s)]"))
