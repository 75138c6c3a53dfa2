"""What the ranks write during one run, kept bounded whatever they write.

Each rank's stdout and stderr go to a file (the rank writes it through an O_APPEND
descriptor; the pytest side reads it, even after the rank died). For one run,
:class:`RunOutput`:

- keeps each file under FILE_LIMIT while the rank writes: past it, the file's first
  HEAD_KEPT bytes and its last OUTPUT_LIMIT are kept here and the file is emptied (the rank's
  next write lands at its start), so a rank that floods costs the disk a few MB;
- echoes new lines as they come, "[rank k] ...", under -s or tee-sys, reading at most CHUNK
  bytes of each file per call and showing at most LINE_LIMIT bytes of a line, so the run's
  loop (and the test's bound) is never held up and this process's memory stays bounded;
- gives each stream's text for the report: its head, how many bytes were cut, its tail.
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
# How often it looks at the files' sizes otherwise (a flood fills a disk in seconds).
BOUND_POLL_S = 0.25
FILE_LIMIT = 16 * 1024 * 1024  # a rank's output file is cut past this many bytes
HEAD_KEPT = 16 * 1024  # of a cut file, its first bytes kept for the report
CHUNK = 256 * 1024  # read of each file per echo: the rest waits for the next one
FINAL_CHUNK = 4 * 1024 * 1024  # read of each file when the run is over; the rest not echoed
LINE_LIMIT = 16 * 1024  # of a line echoed, at most this many bytes are shown


@dataclass(frozen=True)
class LiveStreams:
    """Where rank output is echoed as it comes: the terminal's stdout and stderr, as the
    test's own capture found them (None: this process's sys.stdout/sys.stderr of the moment,
    as with -s)."""

    out: Any = None
    err: Any = None


def tail(path: Path) -> str:
    """The last OUTPUT_LIMIT bytes of a rank's file (a log, or a rank that could not
    start), saying how many came before them."""
    data, size = _last_bytes(path, OUTPUT_LIMIT)
    text = data.decode(errors="replace")
    return text if size <= OUTPUT_LIMIT else f"[... {size - OUTPUT_LIMIT} bytes cut ...]\n{text}"


def _last_bytes(path: Path, count: int) -> tuple[bytes, int]:
    """The last `count` bytes of `path`, and its size (empty and 0 when it cannot be read)."""
    try:
        if os.stat(path).st_size == 0:
            return b"", 0  # what a rank mostly writes, known in one system call instead of five
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - count))
            return f.read(), size
    except OSError:
        return b"", 0


class _Stream:
    """One rank's stdout or stderr file during a run: bounded, echoed, reported."""

    def __init__(self, rank: int, path: Path, is_err: bool) -> None:
        self.rank, self.path, self.is_err = rank, path, is_err
        self.head = b""  # the stream's first bytes, once its file was cut
        self.kept = b""  # the file's last bytes before the latest cut
        self.moved = 0  # bytes the cuts took out of the file (head and kept among them)
        self.offset = 0  # what the echo has read of the file
        self.partial = b""  # a line read without its newline yet
        self.dropped = 0  # bytes never echoed (cut before they were read, or a long line)
        self.in_long_line = False  # the echo shows no more of the current line
        self.pending = b""  # to echo before the file's content

    def bound(self) -> None:
        """Cut the file when it is past FILE_LIMIT: keep its head (once) and its tail here,
        and empty it for the rank to write on."""
        try:
            size = os.stat(self.path).st_size
            if size <= FILE_LIMIT:
                return
            with open(self.path, "rb") as f:
                head = b"" if self.head else f.read(HEAD_KEPT)
                f.seek(max(0, size - OUTPUT_LIMIT))
                tail = f.read(OUTPUT_LIMIT)
                lost_meanwhile = max(0, os.fstat(f.fileno()).st_size - size)
            os.truncate(self.path, 0)
        except OSError:
            return
        self.moved += size + lost_meanwhile
        if head and self.offset < len(head):  # cut before the echo read it: echo its head
            self.pending, self.offset = head[self.offset :], len(head)
        self.head = self.head or head
        self.kept = tail
        self.dropped += max(0, size - self.offset) + lost_meanwhile
        self.offset = 0

    def read_new(self, budget: int) -> bytes:
        if self.pending:  # the head of a file cut before it was read
            data, self.pending = self.pending, b""
            return data
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(budget)
        except OSError:
            return b""
        self.offset += len(data)
        return data

    def unread(self) -> int:
        try:
            return max(0, os.stat(self.path).st_size - self.offset)
        except OSError:
            return 0

    def lines(self, data: bytes, final: bool) -> list[str]:
        """The complete lines in what was read (each shown at most LINE_LIMIT long); the
        unfinished one too when `final`."""
        *complete, rest = (self.partial + data).split(b"\n")
        shown: list[bytes] = []
        for line in complete:
            if self.in_long_line:  # its start was shown already
                self.dropped += len(line)
                self.in_long_line = False
                continue
            shown.append(self._capped(line))
        if len(rest) > LINE_LIMIT and not self.in_long_line:
            shown.append(self._capped(rest))
            self.in_long_line, rest = True, b""
        elif self.in_long_line:
            self.dropped += len(rest)
            rest = b""
        if final and rest:
            shown.append(rest)
            rest = b""
        self.partial = rest
        return [line.decode(errors="replace") for line in shown]

    def _capped(self, line: bytes) -> bytes:
        if len(line) <= LINE_LIMIT:
            return line
        self.dropped += len(line) - LINE_LIMIT
        return line[:LINE_LIMIT] + b" [... the rest of this line is not shown]"

    def report(self) -> str:
        """The stream's text for the report: its last OUTPUT_LIMIT bytes, after its first
        ones and the number of bytes left out between, when its file was cut."""
        data, size = _last_bytes(self.path, OUTPUT_LIMIT)
        if not self.moved:
            text = data.decode(errors="replace")
            cut = size - len(data)
            return f"[... {cut} bytes cut ...]\n{text}" if cut else text
        shown = (self.kept + data)[-OUTPUT_LIMIT:]
        cut = self.moved + size - len(self.head) - len(shown)
        return (
            f"{self.head.decode(errors='replace')}\n[... {cut} bytes cut ...]\n"
            f"{shown.decode(errors='replace')}"
        )


class RunOutput:
    """Every rank's output files during one run (see the module's docstring); `streams`:
    where to echo them (None: not echoed, only bounded and reported)."""

    def __init__(self, files: list[tuple[int, RankFiles]], streams: LiveStreams | None) -> None:
        self.enabled = streams is not None
        self._streams = streams or LiveStreams()
        self._files = [
            _Stream(rank, path, is_err)
            for rank, rank_files in files
            for path, is_err in ((rank_files.stdout, False), (rank_files.stderr, True))
        ]
        self._by_path = {stream.path: stream for stream in self._files}
        self._started = False

    def drain(self, final: bool = False) -> None:
        """Keep the files bounded and echo the complete lines written since the last drain,
        at most CHUNK bytes of each file (FINAL_CHUNK when `final`: the run is over, and a
        last line without its newline goes too)."""
        for stream in self._files:
            stream.bound()
        if not self.enabled:
            return
        out = self._streams.out or sys.stdout
        err = self._streams.err or sys.stderr
        for stream in self._files:
            data = stream.read_new(FINAL_CHUNK if final else CHUNK)
            lines = stream.lines(data, final)
            if final:
                stream.dropped += stream.unread()
                if stream.dropped:
                    lines.append(
                        f"[... {stream.dropped} bytes not shown here; the report has the end]"
                    )
            for line in lines:
                if not self._started:  # off pytest's progress line, onto one of its own
                    out.write("\n")
                    out.flush()
                    self._started = True
                (err if stream.is_err else out).write(f"[rank {stream.rank}] {line}\n")
        out.flush()
        err.flush()

    def report(self, path: Path) -> str:
        """The text of one rank file (its stdout or stderr) for the report."""
        stream = self._by_path.get(path)
        return tail(path) if stream is None else stream.report()
