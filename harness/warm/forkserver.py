"""The harness's fork server, which every rank is a fork of: its start (with what it
preloads, harness/preload.py), its socket directory, and its end with the session.

It is multiprocessing's fork server program, but an instance of the harness's own: never
the module's global one, which a test's own ``get_context("forkserver")`` uses. A test's
children then come from a server of its own making (its environment, its preload), as
without the plugin. The pytest process starts it when a first pool needs ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.reduction
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.common import reaper
from harness.common.protocol import SERVER_DIR as PRELOAD_DIR
from harness.common.protocol import SERVER_PARENT as PRELOAD_PARENT
from harness.warm.preload import PreloadPlan
from harness.warm.start_watch import StartWatch

# Imported by the server before its first fork: every rank starts with them loaded.
SERVER_PRELOAD = [
    "harness.rank.entry",  # the worker, and torch, without torch's NumPy warning
    "harness.rank.forkserver_guard",
    "harness.rank.forkserver_preload",  # last: the test modules' imports (plan), if any
]


# How long the server may take to import what the session asks once it has started:
# a safety net, where no list is asked (its import of torch and the worker before it is
# bounded on time without progress, as a pool's start is: start_watch.py).
SERVER_START_S = 120.0


# The harness's own server: the program is multiprocessing's, the instance (its pid, socket,
# preload list) is not the module's global `_forkserver`.
_server: Any = multiprocessing.forkserver.ForkServer()


class _Popen(multiprocessing.popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, asking the harness's server for the fork."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = multiprocessing.spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            multiprocessing.reduction.dump(prep_data, buf)
            multiprocessing.reduction.dump(process_obj, buf)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        fds: list[int] = getattr(self, "_fds")  # noqa: B009  # the Popen's own, untyped
        self.sentinel, w = _server.connect_to_new_process(fds)
        # a duplicate of the data pipe's write end: the child's sign that this process lives
        parent_w = os.dup(w)
        close_fds: Any = getattr(multiprocessing.util, "close_fds")  # noqa: B009  # untyped
        self.finalizer = multiprocessing.util.Finalize(self, close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = multiprocessing.forkserver.read_signed(self.sentinel)


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)


class _Context(multiprocessing.context.ForkServerContext):
    """A forkserver context whose processes are forks of the harness's server."""

    Process = _Process


_CONTEXT = _Context()


class ServerStartError(RuntimeError):
    """The fork server could not start, or not preload what the tests import."""


@dataclass
class Preloaded:
    """What the server preloaded: counts, time, what it printed, the imports that failed."""

    modules: int = 0
    seconds: float = 0.0
    threads: int = 0  # threads the imports left running in the server (not in its forks)
    cuda: str = ""  # the import that initialised CUDA there (the server was then replaced)
    stale: str = ""  # why what a server started early imported was not the tests' (replaced)
    failed: list[str] = field(default_factory=list)
    output: str = ""
    # When (time.time()) the server was started, had done its own imports ("started"), was
    # handed each list and had imported it ("early-handed", "early-done", "modules-...").
    timeline: dict[str, float] = field(default_factory=dict)
    slowest: list[tuple[str, float]] = field(default_factory=list)  # (module, seconds)


@dataclass
class _Early:
    """A server started before the tests were collected, until a pool takes it."""

    directory: Path
    pid: int
    handed: bool = False  # whether it has the session's list yet
    # Started before the session's conftests loaded: the environment it was started with,
    # until it is given its early list (None once it has one).
    awaiting_early: dict[str, str] | None = None


_waiting: _Early | None = None


def start_early(workdir: Path, early: Sequence[str]) -> bool:
    """Start the server now, while pytest collects: its own imports (torch, the worker) and
    `early` (what the last session preloaded) overlap the collection; it then waits for the
    session's list (hand_over_early). False when a server already runs or the server could
    not import the harness."""
    global _waiting
    if _server_pid() is not None or not _harness_importable_there():
        return False
    _prepare()
    directory = _launch(workdir, early)
    pid = _server_pid()
    _waiting = None if pid is None else _Early(directory, pid)
    return _waiting is not None


def start_before_conftests(workdir: Path, environ: Mapping[str, str]) -> bool:
    """Start the server before the session's conftests load (an adopted suite's session):
    its own imports (torch, the worker) overlap theirs. It starts in `environ` (this
    process's, with what the conftests set last time) and waits for its early list, which
    give_early hands it as collection starts if the conftests left that same environment.
    False when a server already runs or the server could not import the harness."""
    global _waiting
    if _server_pid() is not None or not _harness_importable_there():
        return False
    _prepare()
    directory = _launch(workdir, None, environ)
    pid = _server_pid()
    _waiting = None if pid is None else _Early(directory, pid, awaiting_early=dict(environ))
    return _waiting is not None


def give_early(early: Sequence[str]) -> bool:
    """Hand a server started before the conftests its early list, as collection starts,
    with sys.path and the environment as they are now. Where the conftests left another
    environment than it was started in (a variable a library reads as it is imported), it
    is ended instead, and False returned: the caller starts one afresh (start_early)."""
    waiting = _waiting
    if waiting is None or waiting.awaiting_early is None:
        return False
    if _server_pid() != waiting.pid or dict(os.environ) != waiting.awaiting_early:
        _kill_server()
        return False
    _write_early(waiting.directory, early)
    waiting.awaiting_early = None
    return True


def early_server_waiting() -> bool:
    """Whether a server started early still waits for the session's list."""
    return _waiting is not None and not _waiting.handed


def hand_over_early(plan: PreloadPlan) -> None:
    """Give a server started early the session's list, once the tests are collected: it
    goes on importing while the session's first tests run. (Until then it serves no fork:
    multiprocessing's server serves only once its preload is done.)"""
    if _waiting is None or _waiting.handed or _server_pid() != _waiting.pid:
        return
    _hand_over_to(_waiting, plan)


def _hand_over_to(early: _Early, plan: PreloadPlan) -> None:
    """The session's list to a server started early; an empty early list first where it
    still waits for one (its session never reached its collection)."""
    if early.awaiting_early is not None:
        _write_early(early.directory, ())
        early.awaiting_early = None
    _hand_over(early.directory, plan, started_early=True)
    early.handed = True


def release_early(workdir: Path) -> None:
    """At a session's end: a server it started early that no pool took is ended (a pytest
    run inside another keeps the process, and the server's directory goes with the session)."""
    if _waiting is not None and _waiting.directory.parent == workdir:
        _kill_server()


def context(
    start_method: str, plan: PreloadPlan | None = None, workdir: Path | None = None
) -> tuple[Any, Preloaded | None]:
    """multiprocessing's context for `start_method`; with the fork server, the server is
    started now if it is not running, preloading `plan`'s modules (files in `workdir`), or
    handed them if it was started early. Also returns what it preloaded: None when it was
    already running without a preload, or there is no plan."""
    global _waiting
    if start_method != "forkserver":
        return multiprocessing.get_context(start_method), None
    ctx = _CONTEXT
    _prepare()
    plan = plan or PreloadPlan((), SERVER_START_S)
    early, _waiting = _waiting, None
    if early is not None and _server_pid() == early.pid:
        if not early.handed:
            _hand_over_to(early, plan)
        found = _preloaded(early.directory, plan)
        if not found.stale:
            return ctx, found
        # What it imported before the tests were collected is not what they import (a
        # conftest set a variable a library read at import, say): a fresh server instead.
        _kill_server()
    if plan.modules and _server_pid() is None and _harness_importable_there():
        directory = _launch(Path(workdir or tempfile.gettempdir()), ())
        _hand_over(directory, plan)
        return ctx, _preloaded(directory, plan)
    return ctx, None


def _preloaded(directory: Path, plan: PreloadPlan) -> Preloaded:
    """Wait for the running server to start, then to preload `plan` (each bounded); what it
    did. A server whose preload initialised CUDA is ended (its forks could not use CUDA):
    multiprocessing then starts a plain one."""
    pid = _server_pid()
    watch = StartWatch()
    _wait_for(
        directory / "started",
        pid,
        directory,
        lambda: watch.expired([pid or 0]),
        lambda: f", with {watch.account(pid or 0)}",
    )
    deadline = time.monotonic() + plan.bound_s
    _wait_for(
        directory / "done",
        pid,
        directory,
        lambda: time.monotonic() >= deadline,
        lambda: f" after {plan.bound_s:g} s (--rank-import-timeout)",
    )
    found = _report(directory)
    if found.cuda:
        _kill_server()
    return found


_importable: bool | None = None


def _harness_importable_there() -> bool:
    """Whether a fresh interpreter started as multiprocessing starts the server (this cwd
    and environment; before Python 3.12 without this process's sys.path) imports this same
    harness: where it cannot (a checkout found only through pytest's `pythonpath`), nothing
    is preloaded and the ranks import what they need themselves, as before."""
    global _importable
    if _importable is None:
        here = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))  # harness/
        probe = (
            "import importlib.util as u; s = u.find_spec('harness'); print(s.origin if s else '')"
        )
        try:
            found = subprocess.run(
                [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            found = ""
        _importable = bool(found) and os.path.realpath(os.path.dirname(found)) == here
    return _importable


def _prepare() -> None:
    _socket_dir_short_enough()
    _server.set_forkserver_preload(SERVER_PRELOAD)


def socket_directory() -> str | None:
    """Where multiprocessing keeps the fork server's socket (its pymp-XXXX directory), once
    the server runs; None before."""
    if _server_pid() is None:
        return None
    return str(multiprocessing.util.get_temp_dir())


def _server_pid() -> int | None:
    """The running server's pid (never reaped here: multiprocessing reaps its own)."""
    pid = getattr(_server, "_forkserver_pid", None)
    return int(pid) if pid is not None and reaper.alive(pid) else None


@contextlib.contextmanager
def default_start_method_kept() -> Iterator[None]:
    """Start a rank without fixing this process's default start method.

    CPython reads the default start method while preparing a forkserver or spawn child (and
    a fork server that preloads), which fixes it when nothing had: a later test's own
    ``multiprocessing.set_start_method`` would then raise "context has already been set".
    """
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        yield
    finally:
        if before is None:
            multiprocessing.set_start_method(None, force=True)  # back to unset


def _launch(
    workdir: Path, early: Sequence[str] | None, environ: Mapping[str, str] | None = None
) -> Path:
    """Start the server with a directory of its own for the preload (see
    rank/forkserver_preload.py), `early` its first list (None: it waits for one, see
    give_early), in `environ` (by default this process's)."""
    directory = Path(tempfile.mkdtemp(prefix="preload-", dir=workdir))
    (directory / "launched").write_text(f"{time.time():.3f}")
    if early is not None:
        _write_early(directory, early)
    said = {PRELOAD_DIR: str(directory), PRELOAD_PARENT: str(os.getpid())}  # the server drops
    started_in = _environment(environ, said)
    with started_in, _output_into(directory / "output"), default_start_method_kept():
        _server.ensure_running()
    return directory


def _write_early(directory: Path, early: Sequence[str]) -> None:
    """The early list, with sys.path and the environment as they are now; the list last,
    in one rename the server may be waiting for."""
    (directory / "early.path").write_text("\n".join(sys.path) + "\n")
    (directory / "early.env").write_text(json.dumps(dict(os.environ)))  # 0700, as modules.env
    partial = directory / "early.partial"
    partial.write_text("\n".join(early) + "\n")
    partial.rename(directory / "early")


@contextlib.contextmanager
def _environment(environ: Mapping[str, str] | None, extra: Mapping[str, str]) -> Iterator[None]:
    """This process's environment as `environ` (where given) plus `extra` while the server
    is started (it inherits it), then as it was. Only at a server's start, which no thread
    of this process's races (the harness starts it from pytest's main thread)."""
    saved = dict(os.environ)
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _output_into(path: Path) -> Iterator[None]:
    """Start the server with its stdout and stderr going to `path`, as its preload's output
    does: what it prints as it imports torch (a warning, say) is shown on the first test's
    report, or nowhere if no test uses ranks, never raw on pytest's terminal."""
    for stream in (sys.stdout, sys.stderr):  # what this process wrote stays its own
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for each in (fd, *saved):
            os.close(each)


def _hand_over(directory: Path, plan: PreloadPlan, started_early: bool = False) -> None:
    """The session's list, with sys.path and the environment as they were when the tests
    were collected, in one rename the server waits for; to a server started early, also
    where this process imported the list's top-level packages from, for it to check what it
    imported before (see rank/forkserver_preload.py)."""
    (directory / "modules.path").write_text("\n".join(sys.path) + "\n")
    env = directory / "modules.env"  # in the session's 0700 work directory
    env.write_text(json.dumps(dict(plan.environ)))
    if started_early:
        (directory / "modules.files").write_text(json.dumps(_top_level_files(plan.modules)))
    partial = directory / "modules.partial"
    partial.write_text("\n".join(plan.modules) + "\n")
    partial.rename(directory / "modules")


def _top_level_files(names: Sequence[str]) -> dict[str, str]:
    """Where this process imported each top-level package of `names` from (real paths)."""
    found = {}
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None) if "." not in name else None
        if isinstance(file, str):
            found[name] = os.path.realpath(file)
    return found


def _wait_for(
    path: Path,
    pid: int | None,
    directory: Path,
    expired: Callable[[], bool],
    bound: Callable[[], str],
) -> None:
    """Wait until the server writes `path`; raise if it dies first or once `expired` (what
    `bound` then says)."""
    while not path.exists():
        alive = pid is not None and reaper.alive(pid)
        if alive and not expired():
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
        _kill_server()
        what = f"was still {doing}{bound()}" if alive else f"died {doing}"
        raise ServerStartError(
            f"the fork server {what}; its output:\n{_read(directory / 'output')}\n"
            f"Run with --rank-preload none to have each rank import them itself."
        )


def _report(directory: Path) -> Preloaded:
    found = Preloaded(output=_read(directory / "output"))
    with contextlib.suppress(ValueError):
        found.timeline["launched"] = float(_read(directory / "launched"))
    for line in _read(directory / "done").splitlines():
        key, _, value = line.partition(" ")
        if key == "imported":
            found.modules = int(value)
        elif key == "seconds":
            found.seconds = float(value)
        elif key == "threads":
            found.threads = int(value)
        elif key == "cuda":
            found.cuda = value
        elif key == "stale":
            found.stale = value
        elif key == "failed":
            found.failed.append(value)
        elif key in ("at", "took"):
            name, _, number = value.rpartition(" ")
            with contextlib.suppress(ValueError):
                if key == "at":
                    found.timeline[name] = float(number)
                else:
                    found.slowest.append((name, float(number)))
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
    """End multiprocessing's fork server, if this process started one, and reap it; then its
    resource tracker.

    Left alone it ends only once this process has exited and it notices, then spends a
    second or so tearing torch down: a process outliving the session. Its ranks are dead by
    now, so it is killed (a clean stop would cost that second here instead), after whatever
    it adopted from ranks that died (their orphaned children).
    """
    if _kill_server():
        _stop_resource_tracker()


def _kill_server() -> bool:
    """Kill and reap the fork server and what is below it; multiprocessing starts a new one
    when next asked. False when none was started."""
    global _waiting
    _waiting = None
    server = _server
    with server._lock:
        pid = getattr(server, "_forkserver_pid", None)
        if pid is None:
            return False
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
    return True


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
