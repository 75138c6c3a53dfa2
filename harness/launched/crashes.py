"""A launched rank's fatal signal, named at once by a rank beside it on its node.

A rank killed by SIGSEGV (or SIGABRT, SIGBUS, ...) publishes nothing, and its peers on other
nodes would learn it was gone only once its heartbeat had been silent for a test's timeout.
So where a node runs two ranks or more, each writes faulthandler's crash report to a file of
its own (in a directory only this user can open), and the heartbeat of every other rank there
looks for a rank beside it whose process has ended with such a report: it publishes what the
report says under died/<rank>, which every peer reads within a beat, and prints the report on
its node's terminal (the crashed rank's stderr no longer has it). A node with one rank keeps
pytest's own faulthandler: no one beside it could read the file.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import signal
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from harness.common import reaper
from harness.common.stacks import crash_stack

# faulthandler's words for each fatal signal it reports.
_SIGNALS = {
    "Segmentation fault": signal.SIGSEGV,
    "Aborted": signal.SIGABRT,
    "Bus error": signal.SIGBUS,
    "Floating-point exception": signal.SIGFPE,
    "Illegal instruction": signal.SIGILL,
}


def _directory() -> Path | None:
    """This user's own directory for crash reports (None if one cannot be had safely)."""
    path = Path(tempfile.gettempdir()) / f"rankwise-crashes-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    found = path.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        return None  # another user's, or open to others: not used
    return path


def report_path(job: str, rank: int) -> Path | None:
    """Where rank `rank` of the launch `job` (its store prefix) writes its crash report."""
    directory = _directory()
    if directory is None:
        return None
    return directory / f"{hashlib.sha256(job.encode()).hexdigest()[:16]}-{rank}"


class Crashes:
    """This rank's crash report, and the ranks beside it on its node whose reports it reads."""

    def __init__(self, job: str, rank: int, beside: dict[int, int]) -> None:
        self._job, self._rank = job, rank
        self._beside = beside  # rank -> pid, the other ranks on this node
        self._named: set[int] = set()
        self._file: IO[str] | None = None

    def watch_own(self) -> None:
        """faulthandler writes this rank's crash report to its file from now on."""
        path = report_path(self._job, self._rank)
        if path is None or not self._beside:
            return
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._file = open(fd, "w")  # noqa: SIM115 - kept open for faulthandler
        faulthandler.enable(file=self._file, all_threads=False)

    def look(self, publish: Callable[[int, str], None], say: Callable[[str], None]) -> None:
        """Name each rank beside this one that died of a fatal signal, once (a heartbeat)."""
        for rank, pid in self._beside.items():
            if rank in self._named or reaper.alive(pid):
                continue
            path = report_path(self._job, rank)
            report = crash_stack(path) if path is not None else ""
            if not report:
                continue  # it ended otherwise (or has not finished writing): its peers judge it
            self._named.add(rank)
            name = next((n for words, n in _SIGNALS.items() if words in report), None)
            killed = f"killed by {name.name}" if name is not None else "a fatal error"
            text = f"{killed} (seen by rank {self._rank} on its node)\n{report}"
            publish(rank, json.dumps({"text": text, "signal": name, "code": None}))
            say(f"harness: rank {rank} (pid {pid}) died, {killed}:\n{report}")
            with contextlib.suppress(OSError):
                path.unlink()  # type: ignore[union-attr]

    def close(self) -> None:
        """At the session's end: this rank's report file goes (nothing was written to it;
        faulthandler keeps writing to the open file, should the process crash after)."""
        path = report_path(self._job, self._rank)
        if self._file is not None and path is not None:
            with contextlib.suppress(OSError):
                path.unlink()
