"""Rank output as it comes: each rank's stdout and stderr files echoed, line by line and
prefixed with the rank, to the terminal (pytest -s, tee-sys); and the tail of a rank's file
that a report keeps.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.common.protocol import OUTPUT_LIMIT, RankFiles

# How often the run loop echoes new output while output streams live.
LIVE_POLL_S = 0.1


@dataclass(frozen=True)
class LiveStreams:
    """Where rank output is echoed as it comes: the terminal's stdout and stderr, as the
    test's own capture found them (None: this process's sys.stdout/sys.stderr of the moment,
    as with -s)."""

    out: Any = None
    err: Any = None


def tail(path: Path) -> str:
    try:
        if os.stat(path).st_size == 0:
            return ""  # what a rank mostly writes, known in one system call instead of five
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - OUTPUT_LIMIT))
            data = f.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return text if size <= OUTPUT_LIMIT else f"[... {size - OUTPUT_LIMIT} bytes cut ...]\n{text}"


class LiveOutput:
    """Echoes new lines of each rank's output files, prefixed: its stdout to this process's
    stdout, its stderr to stderr."""

    def __init__(self, files: list[tuple[int, RankFiles]], streams: LiveStreams | None) -> None:
        self.enabled = streams is not None
        self._streams = streams or LiveStreams()
        self._files = [
            (rank, path, is_err)
            for rank, rank_files in files
            for path, is_err in ((rank_files.stdout, False), (rank_files.stderr, True))
        ]
        self._offsets = {path: 0 for _, path, _ in self._files}
        self._partial = {path: b"" for _, path, _ in self._files}
        self._started = False

    def drain(self, final: bool = False) -> None:
        """Echo the complete lines written since the last drain; `final`: the run is over,
        so a last line without its newline goes too."""
        if not self.enabled:
            return
        out = self._streams.out or sys.stdout
        err = self._streams.err or sys.stderr
        for rank, path, is_err in self._files:
            data = self._partial[path] + self._read_new(path)
            *lines, self._partial[path] = data.split(b"\n")
            if final and self._partial[path]:
                lines.append(self._partial[path])
                self._partial[path] = b""
            for line in lines:
                if not self._started:  # off pytest's progress line, onto one of its own
                    out.write("\n")
                    out.flush()
                    self._started = True
                (err if is_err else out).write(f"[rank {rank}] {line.decode(errors='replace')}\n")
        out.flush()
        err.flush()

    def _read_new(self, path: Path) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets[path])
                data = f.read()
        except OSError:
            return b""
        self._offsets[path] += len(data)
        return data
