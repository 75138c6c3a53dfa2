"""The warm ranks of one pytest process: a pool per (world size, backend, start method),
the private store their groups meet through, the group each pool kept after a clean run,
and a run's set-up retried when it failed on every rank.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from harness.common import environment, loopback, reaper, signing
from harness.common.outcome import RankOutcome
from harness.common.protocol import CURRENT_TEST, RankSpec, RunTask, StartMethod, Target
from harness.common.rank_state import RankState
from harness.plan import measured
from harness.seam import Cut
from harness.warm import forkserver, workdir
from harness.warm.live_output import LiveStreams
from harness.warm.preload import PreloadPlan
from harness.warm.processes import Pool, PoolKey, PoolStartError

# A group set-up that failed on every rank (the body never ran) is retried this many times,
# while at least MIN_SET_UP_RETRY_S of the run's bound is left.
SET_UP_ATTEMPTS = 3
MIN_SET_UP_RETRY_S = 1.0


@dataclass(frozen=True)
class RunRequest:
    """One run on every rank: how (the spec), what to call, and its encoded arguments."""

    spec: RankSpec
    target: Target
    args_blob: bytes
    live: LiveStreams | None = None  # pytest -s or tee-sys: echo rank output as it comes
    # Told the rank processes as the run starts (harness.spawn(join=False) hands them out
    # while the run goes on, as torch's context does).
    on_start: Callable[[list[int]], None] | None = None
    cut: Cut | None = None  # the caller's handle to end the run early


class Pools:
    """Every pool of this pytest process, and the private store their groups meet through."""

    def __init__(
        self,
        preload: Callable[[], PreloadPlan | None] = lambda: None,
        endings: Callable[[], list[Callable[[], None]]] = list,
    ) -> None:
        self._pools: dict[PoolKey, Pool] = {}
        # Per pool, the group every rank kept after the last run, and that run's timeout.
        self._kept: dict[PoolKey, tuple[str, float]] = {}
        self._serial = itertools.count(1)
        self._workdir = workdir.make()
        # SIGTERM and SIGHUP (a cancelled CI job, a closed terminal) during a run kill the
        # ranks and remove the work directory first: their default would end this process
        # without a word. Taken only while a run goes on: a plain test keeps its handlers.
        self._signals = workdir.EndingSignals(self._end_now)
        self._running = 0
        self.started_pids: set[int] = set()
        # Pools running a run now: a second run for the same key at once (a join=False spawn,
        # then another) gets spare ranks, never a place in the queue of busy ones.
        self._busy: set[PoolKey] = set()
        self._lock = threading.Lock()
        self.secret = signing.new_secret()  # for the keys the ranks write in the store
        # (rank pids, module, file, mtime) of the test modules the ranks have imported.
        self.modules_loaded: set[tuple[tuple[int, ...], str, str | None, int | None]] = set()
        self._preload = preload  # the session's preload plan, once its tests are collected
        self._endings = endings  # what the adopted suites leave outside their ranks, to undo
        self._server_asked = False  # whether a pool has asked for the fork server yet
        self.preloaded: forkserver.Preloaded | None = None
        # When (time.time()) the first pool was asked for, and had its ranks ready (the fork
        # server's start and preload waited for included): see session.start_timeline.
        self.timeline: dict[str, float] = {}
        self._preload_output = ""  # what preloading printed, until a test's report shows it

    def _new_pool(self, key: PoolKey) -> Pool:
        asked = time.time()
        pool = Pool(key, self._workdir, self._context(key.start_method))
        if "ranks-asked" not in self.timeline:  # the session's first ranks
            self.timeline.update({"ranks-asked": asked, "ranks-ready": time.time()})
        return pool

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
        workdir.note_sockets(self._workdir, forkserver.socket_directory())
        if preloaded is not None:
            self.preloaded, self._preload_output = preloaded, preloaded.output
        return ctx

    def start_server_early(self, early: list[str]) -> bool:
        """Start the fork server before the tests are collected (see forkserver.start_early)."""
        started = forkserver.start_early(self._workdir, early)
        workdir.note_sockets(self._workdir, forkserver.socket_directory())
        return started

    def start_server_before_conftests(self, environ: dict[str, str]) -> bool:
        """Start the fork server before the conftests load (forkserver.start_before_conftests)."""
        started = forkserver.start_before_conftests(self._workdir, environ)
        workdir.note_sockets(self._workdir, forkserver.socket_directory())
        return started

    def give_early(self, early: list[str]) -> bool:
        """Hand a server started before the conftests its early list (forkserver.give_early);
        False where there is none, or its environment was not the session's (ended)."""
        return forkserver.give_early(early)

    def take_preload_output(self) -> str:
        """What the fork server printed preloading the tests' imports; once, then empty."""
        output, self._preload_output = self._preload_output, ""
        return output

    @property
    def store_path(self) -> str:
        """Where the ranks' store lies: a file below the private work directory, which no
        other user can reach (see rank/private_store.py)."""
        return str(self._workdir / "store")

    @property
    def coverage_dir(self) -> Path:
        """Where ranks save what they measured, until the session folds it into its own."""
        return self._workdir / "coverage"

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
        with self._ending_signals_taken():
            return self._run(request)

    @contextlib.contextmanager
    def _ending_signals_taken(self) -> Any:
        with self._lock:
            self._running += 1
            if self._running == 1:
                self._signals.take()
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._signals.give_back()

    def _run(self, request: RunRequest) -> list[RankOutcome]:
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
            outcomes = [o.set_up_tried(attempt) for o in outcomes]
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
            return pool.run(tasks, request.live, request.on_start, request.cut).outcomes
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
        end = pool.run(tasks, request.live, request.on_start, request.cut)
        kept_ids = {state.kept_group for state in end.states}
        in_step = _same_counts(end.states) and _messages_all_received(end.states)
        if len(kept_ids) == 1 and None not in kept_ids and in_step and not pool.broken:
            self._kept[key] = (kept_ids.pop() or "", asked_timeout_s)  # every rank kept it
        return end.outcomes, reuse is not None

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
            start_method=multiprocessing.get_start_method(allow_none=True),
            coverage=measured.setup_for_ranks(self.coverage_dir),
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
        self._signals.give_back()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(reaper.alive(p) for p in self.started_pids):
            time.sleep(0.05)
        return sorted(p for p in self.started_pids if reaper.alive(p))

    def _end_now(self) -> None:
        """This process is being ended by a signal: its ranks killed, and its work directory
        and multiprocessing's socket directory removed (nothing else will)."""
        for pool in list(self._pools.values()):
            pool.close()
        reaper.remove_workdir(self._workdir)
        for ending in self._endings():  # an adopted suite's (DeepSpeed's /dev/shm buffers)
            with contextlib.suppress(Exception):
                ending()


def _same_counts(states: list[RankState]) -> bool:
    """Whether every rank made as many operations on the kept group, and has torch name as
    many groups (kept_group.counts): an operation some ranks skipped would be paired with
    the next test's, and a group some ranks made would shift the next test's group names."""
    counts = {state.kept_counts for state in states}
    return len(counts) == 1 and None not in counts


def _messages_all_received(states: list[RankState]) -> bool:
    """Whether every point-to-point message sent on the kept group was received: what rank
    i sent to j under each tag, j received from i under it (a message left in flight would
    meet the next test)."""
    sent: dict[tuple[int, int, int], int] = {}
    received: dict[tuple[int, int, int], int] = {}
    for rank, state in enumerate(states):
        if state.point_to_point is None:
            return False
        mine_sent, mine_received = state.point_to_point
        sent.update({(rank, peer, tag): n for peer, tag, n in mine_sent})
        received.update({(peer, rank, tag): n for peer, tag, n in mine_received})
    return sent == received
