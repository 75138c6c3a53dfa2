"""The session's work directory in TMPDIR (``harness-XXXX``: the ranks' files, the private
store, the fork server's preload files) and multiprocessing's socket directory
(``pymp-XXXX``): gone however the session ends.

- A normal end, Ctrl-C and pytest.exit remove them as the session closes its pools.
- SIGTERM (how CI cancels a job) and SIGHUP (a closed terminal) would end pytest at once:
  while ranks run, this process takes them, kills its ranks, removes both directories, and
  then ends by the signal as it would have.
- SIGKILL leaves no chance here: the fork server, which outlives pytest by a moment, removes
  them (rank/forkserver_guard.py); failing that, the next session in the same TMPDIR
  removes the directories of every session that is gone (each names its owner).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from harness.common.reaper import WORKDIR_OWNER, WORKDIR_PREFIX, WORKDIR_SOCKETS, remove_workdir

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def make() -> Path:
    """A new private work directory, claimed by this process, after removing those of
    sessions that are gone."""
    remove_stale(Path(tempfile.gettempdir()))
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    (workdir / WORKDIR_OWNER).write_text(f"{os.getpid()} {start_time(os.getpid())}\n")
    return workdir


def note_sockets(workdir: Path, directory: str | None) -> None:
    """Record where multiprocessing keeps its sockets (its pymp-XXXX directory), to be
    removed with the work directory by whoever removes it."""
    if directory and Path(directory).name.startswith("pymp-"):
        with contextlib.suppress(OSError):
            (workdir / WORKDIR_SOCKETS).write_text(directory)


def remove_stale(tmpdir: Path) -> list[Path]:
    """Remove the work directories in `tmpdir` of this user's sessions that are gone (their
    owner no longer runs); directories without an owner's word are left alone."""
    removed: list[Path] = []
    try:
        names = [name for name in os.listdir(tmpdir) if name.startswith(WORKDIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        workdir = tmpdir / name
        if _stale(workdir):
            remove_workdir(workdir)
            removed.append(workdir)
    return removed


def _stale(workdir: Path) -> bool:
    try:
        found = os.lstat(workdir)
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
            return False
        pid_text, started = (workdir / WORKDIR_OWNER).read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return False
    return pid != os.getpid() and start_time(pid) != started


def start_time(pid: int) -> str:
    """When process `pid` started (clock ticks since boot), telling it from a later process
    given the same pid; "" for none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return fields[19] if len(fields) > 19 else ""


class EndingSignals:
    """SIGTERM and SIGHUP, taken while ranks run: `clean` first, then this process ends by
    the signal as it would have. Installed only from the main thread, and only over the
    default handling (a handler the user or another plugin set is theirs)."""

    def __init__(self, clean: Callable[[], None]) -> None:
        self._clean = clean
        self._taken: dict[int, object] = {}

    def take(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in ENDING_SIGNALS:
            if signal.getsignal(signum) == signal.SIG_DFL:
                self._taken[signum] = signal.signal(signum, self._handle)

    def give_back(self) -> None:
        for signum, before in self._taken.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, before)  # type: ignore[arg-type]
        self._taken.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(BaseException):
            self._clean()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
