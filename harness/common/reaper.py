"""No process outlives its test, or pytest: child subreapers and tree kills (Linux).

A rank worker is a child subreaper: whatever its test starts (a child, a child's child in a
new session) stays in the worker's subtree, so the worker can find it when the test ends
and kill it. The forkserver that starts the ranks is a subreaper too, and kills its whole
tree when it exits, which it does when pytest ends, however pytest ends (see
``forkserver_guard``). Elsewhere than Linux these are no-ops. Imports no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1
# Long-lived helpers a process keeps for itself: not a test's leftovers, and killing them
# would break the worker's later use of them (they exit with it). A helper is a direct child
# with one of these in its command line; torch's compile workers run a pool of their own.
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
HELPER_TREES = ("torch._inductor.compile_worker",)
KILL_WAIT_S = 5.0
_ON_LINUX = sys.platform.startswith("linux")
_WALL = 0x40000000  # Linux's __WALL: children started with clone() too, whatever their signal


# In a session's work directory: who owns it, and where multiprocessing keeps its sockets.
WORKDIR_PREFIX = "harness-"  # tempfile.mkdtemp's prefix for it
WORKDIR_OWNER = "owner"  # "<pid> <start time>" of the pytest process whose directory it is
WORKDIR_SOCKETS = "sockets"  # the path of multiprocessing's pymp-XXXX directory, once made


def remove_workdir(workdir: str | os.PathLike[str]) -> None:
    """A session's work directory removed, and the socket directory it records: what a
    session leaves in TMPDIR, once nothing of it runs. Anything not named as a work
    directory is left alone."""
    import shutil

    if not os.path.basename(os.path.normpath(workdir)).startswith(WORKDIR_PREFIX):
        return

    with contextlib.suppress(OSError):
        with open(os.path.join(workdir, WORKDIR_SOCKETS)) as f:
            sockets = f.read().strip()
        if os.path.basename(sockets).startswith("pymp-"):
            shutil.rmtree(sockets, ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children instead of init's."""
    if not _ON_LINUX:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def die_with_parent(on: bool = True, parent: int | None = None) -> None:
    """Have the kernel kill this process when its parent dies (`on`), or no longer. A
    parent already gone when asked (this process's parent is no longer `parent`, the pid
    that started it, where given): this process ends now."""
    if not _ON_LINUX:
        return
    parent = os.getppid() if parent is None else parent
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL if on else 0)
    if on and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def descendants(root: int) -> list[int]:
    """Every live (not zombie) process below `root`, parents before their children."""
    if root == os.getpid() and _childless():
        return []  # the common case after a test, in one system call
    children_of = _children_reader()
    found: list[int] = []
    queue = children_of(root)
    while queue:
        pid = queue.pop(0)
        if _running(pid):
            found.append(pid)
        queue += children_of(pid)
    return found


def _childless() -> bool:
    """Whether this process has no child at all, running or a zombie, of any of its threads
    (every process below it is below one of those: a subreaper adopts the orphans)."""
    if not _ON_LINUX:
        return False
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT | _WALL)
    except ChildProcessError:
        return True
    return False


def _children_reader() -> Callable[[int], list[int]]:
    """How to list a process's children: the kernel's per-thread lists where it has them
    (microseconds), else one scan of every process's parent."""
    if os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        return _children_from_proc
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    return lambda pid: list(children.get(pid, []))


def _children_from_proc(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(child) for child in f.read().split()]
    return found


def command_line(pid: int) -> str:
    """The command line of `pid`; its name in brackets while it has none to show (it is
    exec'ing, or exiting)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            line = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        if line:
            return line
        with open(f"/proc/{pid}/comm") as f:
            return f"[{f.read().strip()}]"
    except OSError:
        return ""


def leftovers(root: int) -> dict[int, str]:
    """The processes a test left below `root`, by pid, with their command lines."""
    below = descendants(root)
    if not below:
        return {}
    direct, own = set(_children_reader()(root)), command_line(root)
    found = {pid: command_line(pid) for pid in below}
    return {pid: line for pid, line in found.items() if not _helper(line, own, pid in direct)}


def settled_leftovers(root: int, not_these: set[int], until: float) -> dict[int, str]:
    """The processes a test left below `root` (less `not_these`), once none of them is on
    its way out by itself: while one still runs (on a CPU or waiting for one), is exiting,
    waits on the disk or has a child just ended, this waits, until `until` (monotonic; the
    test's bound). A child that gave its output and is finishing (an atexit handler, the
    rest of a pipeline whose first stages nobody waited for) is then gone; one that sleeps
    (a server waiting for a request) is a leftover at once; one that never stops running
    is one at the bound. No time decides: a busy machine only makes the wait longer."""
    pause = 0.001
    while True:
        left = {pid: line for pid, line in leftovers(root).items() if pid not in not_these}
        if not left or time.monotonic() >= until or not any(map(_on_its_way, left)):
            return left
        time.sleep(min(pause, max(0.0, until - time.monotonic())))
        pause = min(pause * 1.5, 0.05)


_PF_EXITING = 0x4  # the kernel's flag for a task in its exit


def _on_its_way(pid: int) -> bool:
    """Whether `pid` runs or is runnable (R), waits on the disk (D), is exiting, or has a
    child just ended (a shell about to be woken to reap it)."""
    fields = _stat_fields(pid)
    if len(fields) < 7:
        return False
    if fields[0] in ("R", "D") or int(fields[6]) & _PF_EXITING:
        return True
    return any(_stat_fields(child)[:1] == ["Z"] for child in _children_reader()(pid))


def _helper(line: str, own: str, direct: bool) -> bool:
    """Whether a process is one of `root`'s helpers. A copy of `root` made by os.fork keeps
    its command line (a forkserver's, for a rank), and so do the processes a forkserver the
    test started serves: neither is a helper."""
    if line == own:
        return False
    if any(h in line for h in HELPER_TREES):
        return True
    return direct and any(h in line for h in HELPERS)


def kill(pids: list[int]) -> None:
    """SIGKILL `pids` and wait, bounded, until none runs; reap those that are our children."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            if not _running(pid):
                pending.discard(pid)
        if pending:
            time.sleep(0.01)


def kill_tree(root: int) -> None:
    """Kill everything below `root` (not `root` itself)."""
    kill(descendants(root))


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process."""
    found: dict[int, int] = {}
    if not _ON_LINUX:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields and fields[0] != "Z":
            found[int(entry)] = int(fields[1])
    return found


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, ..."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _running(pid: int) -> bool:
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by its parent, does not);
    without /proc, whether a signal could reach it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not _ON_LINUX
