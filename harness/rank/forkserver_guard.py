"""Imported only in the forkserver that starts the ranks (it is in the server's preload list).

Makes the server a child subreaper, so a rank's descendants stay in its tree even when the
rank dies first, and kills that whole tree when the server exits. The server exits when the
pytest process that started it is gone, however it went (a normal end, Ctrl-C, SIGTERM or
SIGKILL), so no descendant of a rank outlives pytest by more than a moment; and, pytest
being gone, it removes the session's work directory (its ranks' files) as it goes. It leaves
pytest's process group for one of its own: a signal to the whole group (`timeout`, a CI job
cancelled, a terminal closed, a runner's SIGKILL to every process of the job) ends pytest,
and the server, still alive, then kills the ranks and what they started. SIGTERM and SIGHUP
sent to the server itself, which would end it at once without its exit handlers, kill the
tree first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import warnings
from types import FrameType

from harness.common import reaper
from harness.common.protocol import SERVER_DIR

# Signals whose default ends the server without running its exit handlers; a rank sets them
# back to the default (worker.main): it is forked with the server's handlers.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


# The session's work directory (the preload directory's parent): the pytest process names
# the preload directory while it starts the server. Only then does the server know it.
_SERVER_DIR = os.environ.get(SERVER_DIR)
_WORKDIR = os.path.dirname(_SERVER_DIR) if _SERVER_DIR else None
_PYTEST = os.getppid()  # the pytest process that started the server


def _kill_everything_below_me() -> None:
    reaper.kill_tree(os.getpid())
    if _WORKDIR is not None and os.getppid() != _PYTEST:  # pytest is gone: none will now
        reaper.remove_workdir(_WORKDIR)


def end_with_the_tree(signum: int, _frame: FrameType | None) -> None:
    """Kill every descendant, then end by the signal, as its default would have."""
    _kill_everything_below_me()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# Out of pytest's process group: SIGKILL to that group must leave the one process that can
# still end the ranks' orphaned children (Ctrl-C reaches pytest, which ends the session).
with contextlib.suppress(OSError):
    os.setpgid(0, 0)

if reaper.become_subreaper():
    # The server reaps every child; adopted orphans are not the ones it started.
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    atexit.register(_kill_everything_below_me)
    for _signal in ENDING_SIGNALS:
        if signal.getsignal(_signal) == signal.SIG_DFL:  # not ignored (nohup keeps SIGHUP so)
            signal.signal(_signal, end_with_the_tree)
