"""Warm rank processes: a :class:`Pool` is N of them for one (world size, backend, start
method), started once and kept across tests; each :class:`Slot` is one rank process and the
files it writes. Running one task per rank is the run loop's job (run_loop.py); the pool
closes (kills its ranks) when the loop says a rank is suspect.
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import select
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.common import reaper
from harness.common.errors import HarnessError
from harness.common.protocol import (
    COUNT_SIZE,
    ISSUED_SIZE,
    Backend,
    Kind,
    RankFiles,
    RankSpec,
    RunTask,
    StartMethod,
    decode_collectives,
    decode_counts,
    decode_where,
)
from harness.seam import Cut
from harness.warm import forkserver
from harness.warm.live_output import LiveStreams, RunOutput, tail
from harness.warm.run_loop import RunEnd, RunLoop
from harness.warm.start_watch import CHECK_S, StartWatch

_STUCK_START_HINT = {
    "forkserver": "A fork stuck at its start often waits on a lock that a thread of the fork "
    "server held (a preloaded import's thread): try --rank-preload none. ",
}


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


class Slot:
    """One rank process and the files it writes."""

    def __init__(self, ctx: Any, rank: int, workdir: Path) -> None:
        # By its name in sys.modules, as pickle finds it (an in-process pytester session
        # restores sys.modules after each run, leaving the package's attribute stale).
        entry = importlib.import_module("harness.rank.entry")
        self.rank = rank
        self.files = RankFiles.in_dir(workdir, rank)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=entry.main, args=(child, self.files), name=f"harness-rank{rank}"
        )
        with _main_module_hidden(), forkserver.default_start_method_kept():
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

    def empty_output(self) -> None:
        """Empty the rank's output files before its task is sent. The rank writes them
        through O_APPEND descriptors, so its next write lands at the start; were the rank to
        empty them when it reads its task, live output read before then would echo the last
        test's lines and then skip as many bytes of this test's."""
        for path in (self.files.stdout, self.files.stderr, self.files.crash):
            with contextlib.suppress(OSError):
                os.truncate(path, 0)

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


class Pool:
    """N warm ranks. `run` never leaves a rank running: a hung or dead pool is closed."""

    def __init__(self, key: PoolKey, workdir: Path, ctx: Any) -> None:
        self.key = key
        self.broken = False
        self._dir = Path(tempfile.mkdtemp(prefix=f"ranks{key.world_size}-", dir=workdir))
        self.slots: list[Slot] = []
        try:
            self.slots = [Slot(ctx, r, self._dir) for r in range(key.world_size)]
            self._await_ready()
        except BaseException:
            self.close()
            raise

    def _await_ready(self) -> None:
        watch = StartWatch()  # a safety net for a stuck start, not a bound on a slow one
        for index, slot in enumerate(self.slots):
            while not slot.conn.poll(CHECK_S):
                if watch.expired(s.pid for s in self.slots[index:]):
                    raise PoolStartError(
                        f"rank {slot.rank} did not start ({self.key.start_method}): "
                        f"{watch.account(slot.pid)}; its output:\n{slot.read_output()}\n"
                        f"{_STUCK_START_HINT.get(self.key.start_method, '')}"
                        f"See where it waits with: py-spy dump --pid {slot.pid}"
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

    def run(
        self,
        tasks: list[RunTask],
        live: LiveStreams | None = None,
        on_start: Callable[[list[int]], None] | None = None,
        cut: Cut | None = None,
    ) -> RunEnd:
        """Run one task per rank and return how it ended: every rank's outcome and state, in
        rank order; a suspect rank (dead, hung, holding what the next test must not meet)
        closes the pool.

        `live`: echo each rank's output lines there as they come, "[rank k] ..." (-s, tee-sys).
        `on_start`: told the rank processes before the tasks go out. `cut`: the caller's
        handle to end the run early (see run_loop.Cut).
        """
        completed = False
        try:
            if on_start is not None:
                on_start(self.pids)
            output = RunOutput([(s.rank, s.files) for s in self.slots], live)
            end = RunLoop(self.slots, tasks, output, cut).collect()
            completed = True
        finally:
            if not completed:  # Ctrl-C or an internal error mid-run: ranks may still run
                self.close()
        if end.must_close:
            self.close()  # the next test gets a fresh pool, never a suspect rank
        return end

    def close(self) -> None:
        """Kill the ranks and whatever they started (SIGKILL to each rank's process group)."""
        self.broken = True
        for slot in self.slots:
            slot.kill()
        self.slots = []
