"""multiprocessing's fork server, which every rank is a fork of: its start (with what it
preloads, harness/preload.py), its socket directory, and its end with the session.

The server is one per process; the pytest process starts it when a first pool needs ranks.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver  # imported with the pool, so its one server is never orphaned
import multiprocessing.resource_tracker
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import reaper
from harness.preload import PreloadPlan
from harness.rank.forkserver_preload import PRELOAD_DIR

# Imported by the server before its first fork: every rank starts with them loaded.
SERVER_PRELOAD = [
    "harness.rank.worker",
    "harness.rank.forkserver_guard",
    "harness.rank.forkserver_preload",  # last: the test modules' imports (plan), if any
]


# How long the server may take to import torch and the worker before it starts preloading:
# a safety net (it takes seconds), as a pool's own start bound is.
SERVER_START_S = 120.0


class ServerStartError(RuntimeError):
    """The fork server could not start, or not preload what the tests import."""


@dataclass
class Preloaded:
    """What the server preloaded: counts, time, what it printed, the imports that failed."""

    modules: int = 0
    seconds: float = 0.0
    threads: int = 0  # threads the imports left running in the server (not in its forks)
    failed: list[str] = field(default_factory=list)
    output: str = ""


def context(
    start_method: str, plan: PreloadPlan | None = None, workdir: Path | None = None
) -> tuple[Any, Preloaded | None]:
    """multiprocessing's context for `start_method`; with the fork server, the server is
    started now if it is not running, preloading `plan`'s modules (files in `workdir`).
    Also returns what it preloaded: None when it was already running or there is no plan."""
    ctx = multiprocessing.get_context(start_method)
    if start_method != "forkserver":
        return ctx, None
    _socket_dir_short_enough()
    ctx.set_forkserver_preload(SERVER_PRELOAD)
    if plan is None or not plan.modules or _server_pid() is not None:
        return ctx, None
    return ctx, _start_preloading(plan, Path(workdir or tempfile.gettempdir()))


def _server_pid() -> int | None:
    """The running server's pid (never reaped here: multiprocessing reaps its own)."""
    server: Any = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    return int(pid) if pid is not None and reaper.alive(pid) else None


def _start_preloading(plan: PreloadPlan, workdir: Path) -> Preloaded:
    """Start the server with `plan` and wait, at most its bound, until it has imported it."""
    directory = Path(tempfile.mkdtemp(prefix="preload-", dir=workdir))
    (directory / "modules").write_text("\n".join(plan.modules) + "\n")
    (directory / "path").write_text("\n".join(sys.path) + "\n")
    os.environ[PRELOAD_DIR] = str(directory)  # read, then dropped, by the server
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop(PRELOAD_DIR, None)
    pid = _server_pid()
    _wait_for(directory / "started", pid, directory, SERVER_START_S, "")
    _wait_for(directory / "done", pid, directory, plan.bound_s, " (--rank-import-timeout)")
    return _report(directory)


def _wait_for(path: Path, pid: int | None, directory: Path, bound_s: float, which: str) -> None:
    """Wait until the server writes `path`; raise if it dies first or after `bound_s`."""
    deadline = time.monotonic() + bound_s
    while not path.exists():
        alive = pid is not None and reaper.alive(pid)
        if alive and time.monotonic() < deadline:
            time.sleep(0.01)
            continue
        importing = _read(directory / "at")
        doing = (
            f"preloading the test modules' imports, in {importing!r}"
            if importing
            else "starting, before it preloaded the test modules' imports"
        )
        # Ended and reaped either way: a server whose main thread is gone while its other
        # threads still exit is not yet reapable, and multiprocessing would take it for
        # running and send the next rank to it.
        stop_forkserver()
        what = f"was still {doing} after {bound_s:g} s{which}" if alive else f"died {doing}"
        raise ServerStartError(
            f"the fork server {what}; its output:\n{_read(directory / 'output')}\n"
            f"Run with --rank-preload none to have each rank import them itself."
        )


def _report(directory: Path) -> Preloaded:
    found = Preloaded(output=_read(directory / "output"))
    for line in _read(directory / "done").splitlines():
        key, _, value = line.partition(" ")
        if key == "imported":
            found.modules = int(value)
        elif key == "seconds":
            found.seconds = float(value)
        elif key == "threads":
            found.threads = int(value)
        elif key == "failed":
            found.failed.append(value)
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# A Unix socket's path holds at most 107 bytes; multiprocessing puts the forkserver's at
# <its temp dir>/listener-XXXXXXXX, its temp dir being $TMPDIR/pymp-XXXXXXXX.
SOCKET_PATH_MAX = 107
_LISTENER = len("/listener-12345678")
_SHORT_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def _socket_dir_short_enough() -> None:
    """Have multiprocessing keep its sockets under a short directory where TMPDIR is long (a
    CI's workspace): from a TMPDIR of 76 characters, no rank could start."""
    from multiprocessing import util

    if len(tempfile.gettempdir()) + len("/pymp-12345678") + _LISTENER <= SOCKET_PATH_MAX:
        return
    short = next((d for d in _SHORT_TEMP_DIRS if os.access(d, os.W_OK)), None)
    saved = tempfile.tempdir
    try:
        if short is not None:
            tempfile.tempdir = short  # where util makes its directory, unless it has one
        made = util.get_temp_dir()
    finally:
        tempfile.tempdir = saved
    if len(made) + _LISTENER > SOCKET_PATH_MAX:
        raise ServerStartError(
            f"multiprocessing's directory for sockets, {made!r}, is too long for a Unix "
            f"socket ({SOCKET_PATH_MAX} bytes at most): set TMPDIR to a shorter directory, or "
            f"use --rank-start-method spawn"
        )


FORKSERVER_STOP_S = 5.0
TRACKER_STOP_S = 1.0  # it exits in milliseconds unless someone else holds its pipe


def stop_forkserver() -> None:
    """End multiprocessing's fork server, if this process started one, and reap it.

    Left alone it ends only once this process has exited and it notices, then spends a
    second or so tearing torch down: a process outliving the session. Its ranks are dead by
    now, so it is killed (a clean stop would cost that second here instead), after whatever
    it adopted from ranks that died (their orphaned children).
    """
    server: Any = multiprocessing.forkserver._forkserver
    with server._lock:
        pid = getattr(server, "_forkserver_pid", None)
        if pid is None:
            return
        # A rank that died left its children to the server (a subreaper): killed with it,
        # the server would run no step of its own to end them.
        reaper.kill_tree(pid)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        _reap(pid, FORKSERVER_STOP_S)
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        address = server._forkserver_address
        if address and not multiprocessing.util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    _stop_resource_tracker()


def _stop_resource_tracker() -> None:
    """End multiprocessing's resource tracker, started with the fork server, and reap it.

    It ends by itself once every holder of its pipe has closed it: after this process
    exits, a moment too late. Closed here, it frees what is left registered (as it would
    then) and exits; a process still holding the pipe (a user's own child) keeps it, so it
    is waited for only briefly and never killed: it would leave that child's resources.
    """
    tracker: Any = multiprocessing.resource_tracker._resource_tracker
    with tracker._lock:
        fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
        if fd is None or pid is None:
            return
        with contextlib.suppress(OSError):
            os.close(fd)
        tracker._fd = tracker._pid = None
        _reap(pid, TRACKER_STOP_S)


def _reap(pid: int, bound_s: float) -> None:
    """Wait for child `pid` to end, at most `bound_s`."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # not ours to reap, or already reaped
        if done:
            return
        time.sleep(0.01)
