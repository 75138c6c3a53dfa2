"""The entry point of a warm rank process: its bootstrap, the loop that serves the pytest
side's messages, and each task handed to ``task.run`` and undone after.

Self-contained on purpose: it imports nothing from the pytest side (``harness.warm``,
``harness.plugin``), only the message and outcome types both sides share. The forkserver
preloads this module, so torch is imported once in the server and every rank starts with it
already loaded.

A worker serves one slot (rank) of one pool for many tests: it waits for a ``RUN`` message,
runs the task (rank/task.py: the test's group, its body, hygiene), restores the process and
answers with a ``RESULT``. Its stdout and stderr go to two files the pytest process reads
after each run, even if the rank died; ``SIGUSR1`` dumps every thread's Python stack to a
third, also while the rank is blocked in a C++ collective.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import mmap
import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Any

from harness.common import environment, hygiene, reaper
from harness.common.faults import rankwise_points
from harness.common.outcome import Ending
from harness.common.protocol import (
    DUMP_STACKS_SIGNAL,
    WHERE_SIZE,
    Kind,
    Message,
    RankFiles,
    Ready,
    RunTask,
    Settled,
    encode_where,
)
from harness.common.rank_state import RankResult
from harness.rank import (
    group,
    group_release,
    kept_group,
    lasting,
    logs,
    measure,
    raw_threads,
    state,
    stdin,
    store_connect,
    task,
)


def main(conn: Any, files: RankFiles) -> None:
    """Process entry point: serve runs until the pytest side goes away or kills the rank."""
    rank = _bootstrap(files)
    conn.send(Message(Kind.READY, Ready(os.getpid())))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the pytest process is gone
        if message.kind is Kind.DROP_GROUP:
            dropped = kept_group.kept_after(message.payload.key)
            if dropped:
                group.teardown()  # peers still waiting on this rank fail now
            _settle(conn, message.payload.key, check=dropped)
            continue
        logs.empty()  # its output files the pytest side empties before sending the task
        result = rank.serve(message.payload)
        task.end_if_a_forked_copy(None)  # one made in a fixture's teardown: it never reports
        _flush()
        conn.send_bytes(pickle.dumps(Message(Kind.RESULT, result), pickle.HIGHEST_PROTOCOL))
        settles = result.state.settles
        if result.outcome.ending is not Ending.RETURNED or settles:
            _settle(conn, result.outcome.key, check=True, strict=settles)


def _bootstrap(files: RankFiles) -> _Rank:
    """Make this process a rank: its signals, its place under pytest, its output files, and
    the watches the pytest side reads (stacks, where, operations board)."""
    _release_forkserver()
    _default_ending_signals()
    reaper.die_with_parent()  # no rank outlives pytest
    reaper.become_subreaper()  # what a test starts stays below this rank, to be found
    os.setpgrp()  # our own process group: the pool kills the rank and anything it started
    _redirect_output(files)
    logs.use_file(files.log)
    stacks = _StackDump(files.stacks, files.crash)
    _WhereBoard(str(files.where)).observe_points()
    kept_group.watch_operations()
    kept_group.share_issued_count(str(files.issued))
    raw_threads.track()
    group_release.watch_made_groups()
    store_connect.connect_when_listening()
    rank = _Rank(stacks)
    stdin.replace_stdin(lambda: rank.serving)
    task.note_own_pid()
    rank.baseline = state.take(skip_signals=(DUMP_STACKS_SIGNAL,))
    gc.freeze()  # what the rank starts with (torch) is never garbage: no collection walks it
    return rank


class _Rank:
    """This rank process between tasks: what it restores after each, and whom it serves."""

    def __init__(self, stacks: _StackDump) -> None:
        self.stacks = stacks
        self.baseline: state.Baseline | None = None
        self.serving = -1  # the rank of the task this process serves now

    def serve(self, run: RunTask) -> RankResult:
        """Run one task on this rank and undo what the test did to the process; never raises.

        What cannot be undone fails the test on this rank (a leftover the pytest side
        reports), and the pool then replaces its ranks, so the next test is not hurt.
        """
        self.serving = run.rank
        measure.start(run.coverage)  # as the pytest process is measured, if it is
        saved_env = environment.snapshot()
        cuda_device = state.cuda_device()
        outcome, after, test_env = task.run(run)
        measure.save()  # before the result: pytest-cov may combine the files once it has it
        try:
            environment.restore(saved_env if test_env is None else test_env)
            self._restore(cuda_device)  # the default device's mode (set_default_device) too
            measure.resume()  # the restore put back the rank's own trace functions
            outcome = lasting.note_modes_left(outcome)
        except Exception as exc:
            outcome = outcome.with_leftover(
                hygiene.UNDONE,
                f"changed its process in a way the harness could not undo "
                f"({type(exc).__name__}: {exc}); the ranks are replaced for the next test",
            )
            after.give_group_up()
        return RankResult(outcome, after)

    def _restore(self, cuda_device: int | None) -> None:
        """Undo what the test did to this process (see state.py)."""
        if self.baseline is not None:
            state.restore_baseline(self.baseline, cuda_device)
        self.stacks.renew_if_lost()


def _settle(conn: Any, key: str, check: bool, strict: bool = False) -> None:
    """After a group was torn down because a test failed or a peer lags: a group something
    still holds (an FSDP model's mesh, say) keeps its sockets open, and a peer waiting on
    this rank would wait until its timeout instead of failing at once. The rank then ends:
    the kernel closes them. Either way it tells the pytest side first, which waits for this
    before the next run (a rank ending once that run is sent would fail it) and replaces a
    rank that ends. Only after the result is sent: collecting garbage takes tenths of a
    second. `strict` for a group the test set up itself: one still being freed at the
    bound counts as held (its store may still listen on a port the next test wants)."""
    leaving = check and group_release.held_after_test(strict)
    with contextlib.suppress(OSError):
        conn.send(Message(Kind.SETTLED, Settled(key, leaving)))
    if leaving:
        _flush()
        os._exit(0)


def _default_ending_signals() -> None:
    """SIGTERM and SIGHUP as in any new process: a rank is forked with the handlers the
    fork server set for itself (forkserver_guard), which kill the caller's whole tree."""
    guard = sys.modules.get("harness.rank.forkserver_guard")
    for signum in getattr(guard, "ENDING_SIGNALS", ()):
        if signal.getsignal(signum) is getattr(guard, "end_with_the_tree", None):
            signal.signal(signum, signal.SIG_DFL)


def _release_forkserver() -> None:
    """Drop the forkserver's liveness pipe that forkserver children inherit.

    While any rank holds that pipe's write end, the server never sees pytest die, so it
    never exits and PDEATHSIG never fires. Without it, a rank that uses the forkserver start
    method itself (a DataLoader, say) starts a server of its own.
    """
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # private: no public way to drop the pipe
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None
        server._forkserver_address = None


def _redirect_output(files: RankFiles) -> None:
    """fds 1 and 2 into the rank's files, which the pytest side reads even after a death.

    Opened O_APPEND: the pytest side empties them before each task, and the rank's next
    write then lands at the start. fds 1 and 2 are restored after every test (from
    state.py's copies).
    """
    for target, path in ((1, files.stdout), (2, files.stderr)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout, sys.stderr = state.open_streams()


class _StackDump:
    """faulthandler, writing to the rank's files: SIGUSR1 dumps every thread's stack to the
    stacks file (a hang's report), and a fatal signal (SIGSEGV, SIGABRT, ...) the crashing
    thread's to the crash file (where the rank died, as plain pytest shows it). Set so
    again after a test that closed a file, took the signal or turned faulthandler off."""

    def __init__(self, path: Path, crash: Path) -> None:
        self._paths = (path, crash)
        self._files: tuple[Any, Any] = (None, None)
        self._ids: tuple[tuple[int, int], ...] = ()
        self._watch()

    def _watch(self) -> None:
        # Never closed by the object: a test may have closed an earlier one's fd, whose number
        # can belong to something else by now.
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for p in self._paths]
        stacks, crash = (open(fd, "a", closefd=False) for fd in fds)  # noqa: SIM115
        self._files, self._ids = (stacks, crash), tuple(state.file_id(fd) for fd in fds)
        faulthandler.register(DUMP_STACKS_SIGNAL, file=stacks, all_threads=True)
        faulthandler.enable(file=crash, all_threads=False)

    def _still_watched(self) -> bool:
        if signal.getsignal(DUMP_STACKS_SIGNAL) != signal.SIG_DFL:
            return False
        if not faulthandler.is_enabled():
            return False
        try:
            return tuple(state.file_id(f.fileno()) for f in self._files) == self._ids
        except (OSError, ValueError):
            return False

    def renew_if_lost(self) -> None:
        if not self._still_watched():
            signal.signal(DUMP_STACKS_SIGNAL, signal.SIG_DFL)  # Python's view: no handler
            faulthandler.unregister(DUMP_STACKS_SIGNAL)  # else register keeps what it has
            faulthandler.disable()
            self._watch()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class _WhereBoard:
    """A shared-memory note of the labelled collective this rank is in, for hang reports."""

    def __init__(self, path: str) -> None:
        with open(path, "w+b") as f:
            f.truncate(WHERE_SIZE)
            self._map = mmap.mmap(f.fileno(), WHERE_SIZE)
        self._stack: list[str] = []

    def observe_points(self) -> None:
        points = rankwise_points()
        if points is not None:  # harness used without rankwise: nothing to observe
            points.add_observer(self.observe)

    def observe(self, phase: str, kind: str, label: str) -> None:
        if phase == "enter":
            self._stack.append(f"{kind}({label!r})")
        elif self._stack:
            self._stack.pop()
        self._map[:] = encode_where(self._stack)
