"""Imported only in the forkserver that starts the ranks (it is in the server's preload list).

Makes the server a child subreaper, so a rank's descendants stay in its tree even when the
rank dies first, and kills that whole tree when the server exits. The server exits when the
pytest process that started it is gone, however it went (a normal end, Ctrl-C, SIGTERM or
SIGKILL), so no descendant of a rank outlives pytest by more than a moment.
"""

from __future__ import annotations

import atexit
import os
import warnings

from harness import reaper


def _kill_everything_below_me() -> None:
    reaper.kill_tree(os.getpid())


if reaper.become_subreaper():
    # The server reaps every child; adopted orphans are not the ones it started.
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    atexit.register(_kill_everything_below_me)
