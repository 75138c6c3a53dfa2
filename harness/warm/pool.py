"""Warm rank processes: start them, hand them runs, collect every rank's end, kill and replace.

A :class:`Pool` is N worker processes for one (world size, backend, start method); it stays
alive across tests. :class:`Pools` owns the pools of one pytest process and the private store
through which every test's process group meets (rank/private_store.py). Ranks are forks of
multiprocessing's fork server (forkserver.py), which has imported what the tests import.
Imported only when a test first needs ranks, so collection never imports torch.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import multiprocessing
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from harness.common import environment, loopback, reaper, signing
from harness.common.errors import HarnessError
from harness.common.hygiene import UNDONE
from harness.common.outcome import Ending, RankOutcome, outcome_from_exitcode
from harness.common.protocol import (
    COUNT_SIZE,
    CURRENT_TEST,
    ISSUED_SIZE,
    OUTPUT_LIMIT,
    Backend,
    DropGroup,
    Kind,
    Message,
    RankFiles,
    RankSpec,
    RunTask,
    StartMethod,
    Target,
    decode_collectives,
    decode_counts,
    decode_where,
)
from harness.stacks import dump_stacks
from harness.warm import collective_match, forkserver
from harness.warm.preload import PreloadPlan

# After one rank fails, how long its peers get to finish before they count as hung. gloo
# peers fail within milliseconds once the failing rank tears its group down.
FAILURE_GRACE_S = 5.0
TEST_FAILURE_GRACE = "_HARNESS_TEST_FAILURE_GRACE_S"  # the harness's own tests shorten it
# How long a pool may take to start (spawn imports torch once per rank).
START_TIMEOUT_S = 120.0
# A group set-up that failed on every rank (the body never ran) is retried this many times,
# while at least MIN_SET_UP_RETRY_S of the run's bound is left.
SET_UP_ATTEMPTS = 3
MIN_SET_UP_RETRY_S = 1.0


def failure_grace_s() -> float:
    """How long peers of a failure get to finish (FAILURE_GRACE_S, unless a test shortens it)."""
    return float(os.environ.get(TEST_FAILURE_GRACE, FAILURE_GRACE_S))


class PoolStartError(HarnessError):
    """The rank processes could not be started: the test errors with this message alone."""


@dataclass(frozen=True)
class PoolKey:
    """Ranks can serve any run whose spec has the same world size, backend and start method."""

    world_size: int
    backend: Backend
    start_method: StartMethod

    @classmethod
    def of(cls, spec: RankSpec) -> PoolKey:
        return cls(spec.world_size, spec.backend, spec.start_method)


@dataclass(frozen=True)
class RunRequest:
    """One run on every rank: how (the spec), what to call, and its encoded arguments."""

    spec: RankSpec
    target: Target
    args_blob: bytes
    live: LiveStreams | None = None  # pytest -s or tee-sys: echo rank output as it comes


@dataclass(frozen=True)
class LiveStreams:
    """Where rank output is echoed as it comes: the terminal's stdout and stderr, as the
    test's own capture found them (None: this process's sys.stdout/sys.stderr of the moment,
    as with -s)."""

    out: Any = None
    err: Any = None


class _Slot:
    """One rank process and the files it writes."""

    def __init__(self, ctx: Any, rank: int, workdir: Path) -> None:
        from harness.rank import worker

        self.rank = rank
        self.files = RankFiles.in_dir(workdir, rank)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=worker.main, args=(child, self.files), name=f"harness-rank{rank}"
        )
        with _main_module_hidden(), _default_start_method_kept():
            self.process.start()
        child.close()
        self.pid: int = self.process.pid
        self._board: mmap.mmap | None = None  # the rank's operations board, once it exists

    def kill(self) -> None:
        reaper.kill_tree(self.pid)  # what it started, in its session or in new ones
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # the rank and anything it started
        with contextlib.suppress(Exception):
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
        if self._board is not None:
            self._board.close()
            self._board = None

    def read_output(self) -> str:
        """Both streams, for a rank that could not start."""
        return tail(self.files.stdout) + tail(self.files.stderr)

    def board(self, size: int = ISSUED_SIZE) -> bytes:
        """The first `size` bytes of the rank's operations board (see protocol.ISSUED_SIZE),
        read from shared memory; empty until the rank has made it."""
        found = self._mapped_board()
        return b"" if found is None else found[:size]

    def clear_board(self) -> None:
        """Zero the counts before a run, so that no count of the last run is read as this
        one's while the rank has not started it yet."""
        found = self._mapped_board()
        if found is not None:
            found[: COUNT_SIZE * 2] = bytes(COUNT_SIZE * 2)

    def _mapped_board(self) -> mmap.mmap | None:
        if self._board is None:
            try:
                with open(self.files.issued, "r+b") as f:
                    self._board = mmap.mmap(f.fileno(), ISSUED_SIZE)
            except (OSError, ValueError):
                return None
        return self._board

    def read_issued(self) -> int:
        """Operations this rank issued on its group in the current test."""
        return decode_counts(self.board(2 * COUNT_SIZE))[0]

    def collectives_called(self) -> int:
        """Of them, the collectives."""
        return decode_counts(self.board(2 * COUNT_SIZE))[1]

    def read_collectives(self) -> tuple[int, dict[int, str]]:
        """The collectives this rank called on its group in the current test: how many, and
        the last ones' fingerprints by index."""
        return decode_collectives(self.board())

    def read_where(self) -> str:
        with contextlib.suppress(OSError):
            return decode_where(self.files.where.read_bytes())
        return ""


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a rank without multiprocessing re-running the parent's __main__ in it.

    forkserver and spawn children import the parent's main script (as __mp_main__); a
    pytest driven from a script, or from stdin, would run that script once per rank, or
    fail. A rank needs nothing from it: it finds every target by module name.
    """
    main = sys.modules["__main__"]
    names = ("__file__", "__spec__")
    saved: dict[str, Any] = {name: main.__dict__[name] for name in names if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # multiprocessing reads it unguarded
    try:
        yield
    finally:
        main.__dict__.update(saved)


@contextlib.contextmanager
def _default_start_method_kept() -> Iterator[None]:
    """Start a rank without fixing this process's default start method.

    CPython reads the default start method while preparing a forkserver or spawn child,
    which fixes it when nothing had: a later test's own ``multiprocessing.set_start_method``
    would then raise "context has already been set".
    """
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        yield
    finally:
        if before is None:
            multiprocessing.set_start_method(None, force=True)  # back to unset


def _empty_output(files: RankFiles) -> None:
    """Empty a rank's output files before its task is sent. The rank writes them through
    O_APPEND descriptors, so its next write lands at the start; were the rank to empty them
    when it reads its task, live output read before then would echo the last test's lines
    and then skip as many bytes of this test's."""
    for path in (files.stdout, files.stderr):
        with contextlib.suppress(OSError):
            os.truncate(path, 0)


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


LIVE_POLL_S = 0.1
HELD_GROUP = (
    "ended after the test: something still holds its torn-down process group (a subgroup "
    "or DeviceMesh kept in a cache, say), whose sockets only the process's end closes"
)
# How long a rank may take to say it stays after a failure or a dropped group: a safety net
# above its own bounds on the check (group_release.OWN_GROUP_RELEASE_WAIT_S, then garbage
# collection). It says so in milliseconds; only a rank stuck in the check waits it out.
SETTLE_S = 90.0


class LiveOutput:
    """Echoes new lines of each rank's output files, prefixed: its stdout to this process's
    stdout, its stderr to stderr."""

    def __init__(self, slots: list[_Slot], streams: LiveStreams | None) -> None:
        self.enabled = streams is not None
        self._streams = streams or LiveStreams()
        self._files = [
            (s.rank, path, is_err)
            for s in slots
            for path, is_err in ((s.files.stdout, False), (s.files.stderr, True))
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


class Pool:
    """N warm ranks. `run` never leaves a rank running: a hung or dead pool is closed."""

    def __init__(self, key: PoolKey, workdir: Path, ctx: Any) -> None:
        self.key = key
        self.broken = False
        self._dir = Path(tempfile.mkdtemp(prefix=f"ranks{key.world_size}-", dir=workdir))
        self.slots: list[_Slot] = []
        try:
            self.slots = [_Slot(ctx, r, self._dir) for r in range(key.world_size)]
            self._await_ready()
        except BaseException:
            self.close()
            raise

    def _await_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for slot in self.slots:
            remaining = deadline - time.monotonic()
            if not slot.conn.poll(max(0.0, remaining)):
                raise PoolStartError(
                    f"rank {slot.rank} did not start within {START_TIMEOUT_S:.0f} s "
                    f"({self.key.start_method}); its output:\n{slot.read_output()}"
                )
            try:
                message = slot.conn.recv()
            except EOFError:
                slot.process.join(timeout=5)
                raise PoolStartError(
                    f"rank {slot.rank} died while starting (exit code "
                    f"{slot.process.exitcode}); its output:\n{slot.read_output()}"
                ) from None
            assert message.kind is Kind.READY, message

    @property
    def pids(self) -> list[int]:
        return [slot.pid for slot in self.slots]

    def alive(self) -> bool:
        """Whether every rank still runs."""
        if self.key.start_method != "forkserver":
            return all(s.process.is_alive() for s in self.slots)
        # The forkserver writes a rank's exit status to its sentinel: one poll for them all,
        # where is_alive makes a selector per rank.
        poll = select.poll()
        for slot in self.slots:
            poll.register(slot.process.sentinel, select.POLLIN)
        return not poll.poll(0)

    def run(self, tasks: list[RunTask], live: LiveStreams | None = None) -> list[RankOutcome]:
        """Run one task per rank and return every rank's outcome, in rank order.

        `live`: echo each rank's output lines there as they come, "[rank k] ..." (-s, tee-sys).
        """
        completed = False
        try:
            _tell_starting(self.pids)
            outcomes = _Run(self, tasks, tasks[0].spec.timeout_s, live).collect()
            completed = True
            return outcomes
        finally:
            if not completed:  # Ctrl-C or an internal error mid-run: ranks may still run
                self.close()

    def close(self) -> None:
        """Kill the ranks and whatever they started (SIGKILL to each rank's process group)."""
        self.broken = True
        for slot in self.slots:
            slot.kill()
        self.slots = []


# Who wants to know which processes a run on this thread goes to (harness.spawn(join=False)
# hands them out while the run goes on, as torch's context does), by thread.
_start_listeners: dict[int, Callable[[list[int]], None]] = {}


@contextlib.contextmanager
def telling_starts(listener: Callable[[list[int]], None]) -> Iterator[None]:
    """Call `listener` with the rank processes of each run this thread starts while inside."""
    _start_listeners[threading.get_ident()] = listener
    try:
        yield
    finally:
        _start_listeners.pop(threading.get_ident(), None)


@dataclass(frozen=True)
class _Cut:
    at: float  # time.monotonic() when the run ends
    why: str
    asked_at: float


# Runs to end early, by the thread each runs on: when, and why (a harness.spawn run whose
# test failed while it ran: nobody will join it).
_cuts: dict[int, _Cut] = {}


def cut_short(thread_id: int, after_s: float, why: str) -> None:
    """End the run on thread `thread_id` as hung `after_s` from now unless it ends first;
    `why` goes in each stuck rank's note ("still running 5.0 s after <why>; killed")."""
    now = time.monotonic()
    _cuts[thread_id] = _Cut(now + after_s, why, now)


def forget_cut(thread_id: int) -> None:
    _cuts.pop(thread_id, None)


def _tell_starting(pids: list[int]) -> None:
    listener = _start_listeners.get(threading.get_ident())
    if listener is not None:
        listener(list(pids))


class _Run:
    """The pytest side of one run: send, wait for every rank within the deadline, classify."""

    def __init__(
        self, pool: Pool, tasks: list[RunTask], timeout_s: float, live: LiveStreams | None = None
    ) -> None:
        self.pool = pool
        self._live = LiveOutput(pool.slots, live)
        self.slots = list(pool.slots)
        self.tasks = tasks
        self.key = tasks[0].key
        self.timeout_s = timeout_s
        self.outcomes: dict[int, RankOutcome] = {}
        self.first_failure_at: float | None = None
        # When the first rank ended in a way the test did not declare: its peers then get
        # FAILURE_GRACE_S to finish. An ending the test expects (expect(rank=0, does=...)),
        # a skip or an xfail leaves them the whole timeout.
        self.grace_from: float | None = None
        self._expected = tasks[0].spec.expected
        self._grace_s = failure_grace_s()
        self._thread = threading.get_ident()  # a caller may cut the run short (cut_short)
        # Every rank's pipe and process sentinel, polled for the whole run: a selector made
        # per wait (multiprocessing.connection.wait) registers them all again every time.
        self._poll = select.poll()
        self._watched: dict[int, tuple[_Slot, bool]] = {}  # fd -> (slot, is its pipe)
        self._to_settle: set[int] = set()  # ranks that say whether they stay (Kind.SETTLED)
        self._compared = 0  # collectives every rank had called, when last compared
        self._mismatch_found: collective_match.Mismatch | None = None

    def collect(self) -> list[RankOutcome]:
        start = time.monotonic()
        for slot in self.slots:
            self._watch(slot)
            _empty_output(slot.files)
            slot.clear_board()
        for slot, task in zip(self.slots, self.tasks, strict=False):
            try:  # plain pickle: a task needs none of ForkingPickler's reducers
                slot.conn.send_bytes(pickle.dumps(Message(Kind.RUN, task), pickle.HIGHEST_PROTOCOL))
            except OSError:  # BrokenPipeError included: the rank is already dead
                self._record_death(slot)
        deadline = start + self.timeout_s
        while len(self.outcomes) < len(self.slots):
            limit = deadline
            if self.grace_from is not None:
                limit = min(deadline, self.grace_from + self._grace_s)
            cut = _cuts.get(self._thread)
            if cut is not None:
                limit = min(limit, cut.at)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                self._handle_hang(cut if cut is not None and cut.at < deadline else None)
                break
            self._wait_once(min(remaining, self._poll_s()))
            self._live.drain()
            self._drop_kept_groups_if_peers_lag()
            self._fail_on_a_mismatch()
        self._live.drain(final=True)
        self._name_a_mismatch()
        for slot in self.slots:
            self.outcomes[slot.rank].stdout = tail(slot.files.stdout)
            self.outcomes[slot.rank].stderr = tail(slot.files.stderr)
            self.outcomes[slot.rank].log = tail(slot.files.log).rstrip("\n")
        # A rank with a thread of the test's still running is not clean for the next test.
        suspect = any(
            o.ending in _NOT_REUSABLE or {"threads", UNDONE} & o.leftovers.keys() or o.replace_after
            for o in self.outcomes.values()
        )
        if not suspect and not self._all_stay():
            suspect = True  # a rank ends (a group it cannot drop), or never said: replaced
        if suspect:
            self.pool.close()  # the next test gets a fresh pool, never a suspect rank
        return [self.outcomes[slot.rank] for slot in self.slots]

    def _all_stay(self) -> bool:
        """Wait for each rank that is to settle (after a failure on it, or a dropped group)
        to say it stays; False when one ends or says nothing within SETTLE_S, noted as the
        reason it is replaced. A rank that ended once the next run was sent to it would fail
        that run."""
        pending = {s.conn: s for s in self.slots if s.rank in self._to_settle}
        deadline = time.monotonic() + SETTLE_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                for slot in pending.values():
                    self._replaced(slot.rank, f"did not say within {SETTLE_S:g} s whether it stays")
                return False
            ready: list[Any] = multiprocessing.connection.wait(list(pending), timeout=left)
            for conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._replaced(pending[conn].rank, "ended after the test")
                    return False
                said = message.payload
                if message.kind is Kind.SETTLED and said.key == self.key:
                    if said.leaving:
                        self._replaced(pending[conn].rank, HELD_GROUP)
                        return False
                    del pending[conn]
        return True

    def _replaced(self, rank: int, why: str) -> None:
        outcome = self.outcomes.get(rank)
        if outcome is not None and not outcome.replace_after:
            outcome.replace_after = why

    def _poll_s(self) -> float:
        """How long one wait may block: short while output streams live or a run is on the
        harness's group (its kept groups and collectives are watched)."""
        # On the harness's group, the ranks' collectives are compared as they go: a rank
        # blocked in one its peers called differently gives no other sign.
        cuttable = self.tasks[0].spec.bare  # a run without a group (harness.spawn's may be cut)
        watched = self._live.enabled or self._on_harness_group or cuttable
        return LIVE_POLL_S if watched else float("inf")

    @property
    def _on_harness_group(self) -> bool:
        """Whether the run is on a group the harness sets up (not the test's own: bare or
        launch mode), whose operations the ranks count on their boards."""
        return not self.tasks[0].spec.bare and self.tasks[0].launch_port is None

    def _drop_kept_groups_if_peers_lag(self) -> None:
        """Returned ranks give their kept group up once a peer failed, or once a peer still
        running has issued more operations on the group in this test than a returned rank
        did (it waits on a rank that will not answer): that peer then fails at once, as it
        would had they torn their group down, and no group is kept. A peer that is merely
        slow (a busy machine) has issued no such operation: it is waited for, up to the
        test's own bound."""
        kept = [o for o in self.outcomes.values() if o.kept_group]
        if not kept or len(self.outcomes) == len(self.slots):
            return
        if self.first_failure_at is None and not self._a_peer_waits_on(kept):
            return
        for outcome in kept:
            self._give_group_up(outcome)

    def _give_group_up(self, outcome: RankOutcome) -> None:
        """Tell a rank that kept its group to tear it down; it then says whether it stays."""
        outcome.kept_group = None
        slot = next(s for s in self.slots if s.rank == outcome.rank)
        with contextlib.suppress(OSError):
            slot.conn.send(Message(Kind.DROP_GROUP, DropGroup(self.key)))
            self._to_settle.add(outcome.rank)

    def _a_peer_waits_on(self, returned: list[RankOutcome]) -> bool:
        """Whether a rank still running has issued an operation no returned rank will match,
        or the ranks called a collective differently (one may wait for good)."""
        done = {o.rank for o in returned}
        least = min(s.read_issued() for s in self.slots if s.rank in done)
        if any(s.read_issued() > least for s in self._pending()):
            return True
        return self._mismatch() is not None

    def _mismatch(self) -> collective_match.Mismatch | None:
        """The first collective the ranks called differently on the harness's group."""
        if not self.tasks[0].spec.collective_check or not self._on_harness_group:
            return None  # turned off, or the test's own group: not counted
        if self._mismatch_found is not None:
            return self._mismatch_found
        reached = min(s.collectives_called() for s in self.slots)
        if reached <= self._compared:  # what every rank has called, compared already
            return None
        boards = {s.rank: s.read_collectives() for s in self.slots}
        self._mismatch_found = collective_match.find(boards, since=self._compared)
        self._compared = reached
        return self._mismatch_found

    def _fail_on_a_mismatch(self) -> None:
        """Collectives called differently fail the run as a rank's failure does: the ranks
        still running get the failure grace (they may wait in them for good)."""
        if self.grace_from is None and self._mismatch() is not None:
            self.first_failure_at = self.grace_from = time.monotonic()

    def _name_a_mismatch(self) -> None:
        """A collective called differently: its odd rank is the root cause, and no rank
        keeps the group (collectives left unmatched on it would meet the next test's)."""
        mismatch = self._mismatch()
        if mismatch is None:
            return
        collective_match.blame(mismatch, self.outcomes)
        for outcome in self.outcomes.values():
            if outcome.kept_group:
                self._give_group_up(outcome)

    def _pending(self) -> list[_Slot]:
        return [s for s in self.slots if s.rank not in self.outcomes]

    def _watch(self, slot: _Slot) -> None:
        for fd, is_conn in ((slot.conn.fileno(), True), (slot.process.sentinel, False)):
            self._poll.register(fd, select.POLLIN)
            self._watched[fd] = (slot, is_conn)

    def _unwatch(self, rank: int) -> None:
        for fd, (slot, _) in list(self._watched.items()):
            if slot.rank == rank:
                self._poll.unregister(fd)
                del self._watched[fd]

    def _wait_once(self, timeout: float) -> None:
        ms = None if math.isinf(timeout) else math.ceil(timeout * 1000)
        for fd, _ in self._poll.poll(ms):
            slot, is_conn = self._watched.get(fd, (None, False))
            if slot is None or slot.rank in self.outcomes:
                continue
            if is_conn or slot.conn.poll():
                self._receive(slot)
            else:
                self._record_death(slot)

    def _receive(self, slot: _Slot) -> None:
        try:
            message = slot.conn.recv()
        except (EOFError, OSError):
            self._record_death(slot)
            return
        outcome = message.payload
        if message.kind is not Kind.RESULT or outcome.key != self.key:
            return  # a late answer to an earlier run is never credited to this one
        self._record(outcome)
        if outcome.ending is not Ending.RETURNED or outcome.settles:
            self._to_settle.add(outcome.rank)  # it checks its torn-down group, then says

    def _record_death(self, slot: _Slot) -> None:
        slot.process.join(timeout=5)
        outcome = outcome_from_exitcode(
            self.key, slot.rank, slot.pid, slot.process.exitcode, time.monotonic()
        )
        self._record(outcome)

    def _record(self, outcome: RankOutcome) -> None:
        self.outcomes[outcome.rank] = outcome
        self._unwatch(outcome.rank)
        if not outcome.ok and self.first_failure_at is None:
            self.first_failure_at = time.monotonic()
        if self.grace_from is None and self._unexpected(outcome):
            self.grace_from = time.monotonic()

    def _unexpected(self, outcome: RankOutcome) -> bool:
        if outcome.ending in (Ending.SKIPPED, Ending.XFAILED):
            return False
        if self._expected:
            return not self._expected[outcome.rank].matches(outcome)
        return not outcome.ok

    def _handle_hang(self, cut: _Cut | None = None) -> None:
        """Dump the stuck ranks' Python stacks; `collect` then closes the pool. `cut`: the
        run was cut short (when, and why)."""
        stuck = self._pending()
        stacks = dump_stacks({s.rank: (s.pid, s.files.stacks) for s in stuck})
        now = time.monotonic()
        for slot in stuck:
            outcome = RankOutcome(
                self.key,
                slot.rank,
                slot.pid,
                Ending.HUNG,
                at=now,
                stack=stacks.get(slot.rank, ""),
                where=slot.read_where(),
                after_failure=self.grace_from is not None,
            )
            if cut is not None:
                waited = now - cut.asked_at
                outcome.notes.append(f"still running {waited:.1f} s after {cut.why}; killed")
            elif self.grace_from is not None:
                waited = now - self.grace_from
                outcome.notes.append(f"still running {waited:.1f} s after a peer failed; killed")
            else:
                outcome.notes.append(f"still running at the {self.timeout_s:g} s timeout; killed")
            self.outcomes[slot.rank] = outcome


_NOT_REUSABLE = (Ending.HARD_EXIT, Ending.SIGNALLED, Ending.HUNG)


class Pools:
    """Every pool of this pytest process, and the private store their groups meet through."""

    def __init__(self, preload: Callable[[], PreloadPlan | None] = lambda: None) -> None:
        self._pools: dict[PoolKey, Pool] = {}
        # Per pool, the group every rank kept after the last run, and that run's timeout.
        self._kept: dict[PoolKey, tuple[str, float]] = {}
        self._serial = itertools.count(1)
        self._workdir = Path(tempfile.mkdtemp(prefix="harness-"))
        self.started_pids: set[int] = set()
        # Pools running a run now: a second run for the same key at once (a join=False spawn,
        # then another) gets spare ranks, never a place in the queue of busy ones.
        self._busy: set[PoolKey] = set()
        self._lock = threading.Lock()
        self.secret = signing.new_secret()  # for the keys the ranks write in the store
        # (rank pids, module, file, mtime) of the test modules the ranks have imported.
        self.modules_loaded: set[tuple[tuple[int, ...], str, str | None, int | None]] = set()
        self._preload = preload  # the session's preload plan, once its tests are collected
        self._server_asked = False  # whether a pool has asked for the fork server yet
        self.preloaded: forkserver.Preloaded | None = None
        self._preload_output = ""  # what preloading printed, until a test's report shows it

    def _new_pool(self, key: PoolKey) -> Pool:
        return Pool(key, self._workdir, self._context(key.start_method))

    def _context(self, start_method: StartMethod) -> Any:
        """multiprocessing's context for new ranks. The first pool to use the fork server
        starts it with the session's preload plan: tried once (a plan is never retried)."""
        plan = None
        if start_method == "forkserver" and not self._server_asked:
            self._server_asked = True
            plan = self._preload()
        try:
            ctx, preloaded = forkserver.context(start_method, plan, self._workdir)
        except forkserver.ServerStartError as exc:
            raise PoolStartError(str(exc)) from None
        if preloaded is not None:
            self.preloaded, self._preload_output = preloaded, preloaded.output
        return ctx

    def start_server_early(self, early: list[str]) -> bool:
        """Start the fork server before the tests are collected (see forkserver.start_early)."""
        return forkserver.start_early(self._workdir, early)

    def take_preload_output(self) -> str:
        """What the fork server printed preloading the tests' imports; once, then empty."""
        output, self._preload_output = self._preload_output, ""
        return output

    @property
    def store_path(self) -> str:
        """Where the ranks' store lies: a file below the private work directory, which no
        other user can reach (see rank/private_store.py)."""
        return str(self._workdir / "store")

    def get(self, key: PoolKey) -> Pool:
        pool = self._pools.get(key)
        if pool is None or pool.broken or not pool.alive():
            self._kept.pop(key, None)  # new ranks hold no group
            if pool is not None:
                pool.close()
            pool = self._new_pool(key)
            self._pools[key] = pool
            self.started_pids.update(pool.pids)
        return pool

    def run(self, request: RunRequest) -> list[RankOutcome]:
        """Run `request` on a warm pool for its spec: on the group the last clean run kept
        (gloo; same world and timeout), else on a fresh one.

        A set-up that failed on every rank (the body never ran) is tried again with a fresh
        group, up to SET_UP_ATTEMPTS times within the run's own bound.
        """
        deadline = time.monotonic() + request.spec.timeout_s
        for attempt in range(1, SET_UP_ATTEMPTS + 1):
            remaining = deadline - time.monotonic()
            spec = replace(request.spec, timeout_s=remaining) if attempt > 1 else request.spec
            outcomes, reused = self._run_once(
                replace(request, spec=spec), attempt, request.spec.timeout_s
            )
            # On a kept group, a rank without it (never expected) sets none up: try afresh.
            failed = [o.setup_failed for o in outcomes]
            if not (all(failed) or (reused and any(failed))):
                return outcomes
            for outcome in outcomes:
                outcome.setup_attempts = attempt
            if deadline - time.monotonic() < MIN_SET_UP_RETRY_S:
                break
        return outcomes

    def _run_once(
        self, request: RunRequest, setup_attempt: int, asked_timeout_s: float
    ) -> tuple[list[RankOutcome], bool]:
        """One attempt, and whether it ran on a kept group; a group kept after it serves
        later tests asking `asked_timeout_s` (a retry's group has a little less, under its
        margin over the test's bound)."""
        key = PoolKey.of(request.spec)
        with self._lock:
            busy = key in self._busy
            self._busy.add(key)
        if busy:
            return self._run_on_spare_ranks(request, setup_attempt), False
        try:
            return self._run_on_warm_ranks(request, setup_attempt, asked_timeout_s)
        finally:
            with self._lock:
                self._busy.discard(key)

    def _run_on_spare_ranks(self, request: RunRequest, setup_attempt: int) -> list[RankOutcome]:
        """A run while its key's warm ranks are busy: on ranks started for it, then closed."""
        pool = self._new_pool(PoolKey.of(request.spec))
        self.started_pids.update(pool.pids)
        tasks, _launch_store = self._tasks(request, setup_attempt, None)
        try:
            return pool.run(tasks, request.live)
        finally:
            pool.close()

    def _run_on_warm_ranks(
        self, request: RunRequest, setup_attempt: int, asked_timeout_s: float
    ) -> tuple[list[RankOutcome], bool]:
        key = PoolKey.of(request.spec)
        pool = self.get(key)
        kept = self._kept.pop(key, None)  # a group is reused once, then kept again or not
        spec = request.spec
        reuse = (
            kept[0] if kept is not None and spec.keeps_group and kept[1] == spec.timeout_s else None
        )
        tasks, _launch_store = self._tasks(request, setup_attempt, reuse)
        outcomes = pool.run(tasks, request.live)
        kept_ids = {o.kept_group for o in outcomes}
        in_step = _same_counts(outcomes) and _messages_all_received(outcomes)
        if len(kept_ids) == 1 and None not in kept_ids and in_step and not pool.broken:
            self._kept[key] = (kept_ids.pop() or "", asked_timeout_s)  # every rank kept it
        return outcomes, reuse is not None

    def _tasks(
        self, request: RunRequest, setup_attempt: int, reuse: str | None
    ) -> tuple[list[RunTask], Any]:
        """One task per rank, and the agent store of a launch-mode run (else None), which
        the caller keeps for the run only, as torchrun's agent hosts one."""
        spec = request.spec
        serial = next(self._serial)
        env = environment.variables()
        current_test = env.pop(CURRENT_TEST, None)
        launch_store = self._launch_store() if spec.launch else None
        task = RunTask(
            key=f"{os.getpid()}-{serial}",
            rank=0,
            spec=spec,
            target=request.target,
            args_blob=request.args_blob,
            store_path=self.store_path,
            store_prefix=f"run{serial}/",
            secret=self.secret,
            launch_port=launch_store.port if launch_store is not None else None,
            attempt=serial,
            setup_attempt=setup_attempt,
            reuse_group=reuse,
            keep_group=spec.keeps_group,
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            env=env,
            current_test=current_test,
        )
        return task.for_ranks(spec.world_size), launch_store

    def _launch_store(self) -> Any:
        """A store for one launch-mode run, as torchrun's agent hosts one: on a free port."""
        return loopback.store(timeout=timedelta(seconds=60))

    def close(self) -> list[int]:
        """Kill every rank; return the pids of any still alive 5 s later (there should be none)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        forkserver.release_early(self._workdir)  # before its directory goes
        shutil.rmtree(self._workdir, ignore_errors=True)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(reaper.alive(p) for p in self.started_pids):
            time.sleep(0.05)
        return sorted(p for p in self.started_pids if reaper.alive(p))


def _same_counts(outcomes: list[RankOutcome]) -> bool:
    """Whether every rank made as many operations on the kept group, and has torch name as
    many groups (kept_group.counts): an operation some ranks skipped would be paired with
    the next test's, and a group some ranks made would shift the next test's group names."""
    counts = {o.kept_counts for o in outcomes}
    return len(counts) == 1 and None not in counts


def _messages_all_received(outcomes: list[RankOutcome]) -> bool:
    """Whether every point-to-point message sent on the kept group was received: what rank
    i sent to j under each tag, j received from i under it (a message left in flight would
    meet the next test)."""
    sent: dict[tuple[int, int, int], int] = {}
    received: dict[tuple[int, int, int], int] = {}
    for o in outcomes:
        if o.point_to_point is None:
            return False
        mine_sent, mine_received = o.point_to_point
        sent.update({(o.rank, peer, tag): n for peer, tag, n in mine_sent})
        received.update({(peer, o.rank, tag): n for peer, tag, n in mine_received})
    return sent == received
