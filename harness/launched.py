"""A pytest session that torchrun (or another launcher) started once per rank.

There the harness starts no process: every launched pytest process is one rank. The session
keeps one process group made from the launch, runs each ranks test's body in-process on every
rank, and talks to the other ranks through the launch's store (every wait bounded):

- at the start, ranks agree on the backend and on the tests they collected;
- around each test, on their set-up and then on every rank's outcome, so every rank reaches
  the same verdict; only rank 0 prints it and writes junit, the others are quiet;
- at the end, on one exit status.

A rank that hangs or dies cannot be replaced in-process: ``launched_watch`` reports it and
the session ends there. Imported only in a launched session (it imports torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.launch_detect import Launch
from harness.launched_watch import Watch
from harness.outcome import Ending, RankOutcome

# Bound on the session-level agreements (backend, collection, exit status): ranks reach them
# at about the same time, but collection on a busy node can take a while.
AGREE_S = 300.0
# How long past a test's timeout a rank waits for its peers' outcomes: their own timers fire
# at the timeout and need a moment to dump stacks and publish.
OUTCOME_GRACE_S = 15.0
# The group's own timeout stays past every test's bound, so the harness's timer fires first.
GROUP_TIMEOUT_MARGIN_S = 120.0
# Store polls start fast (ranks usually arrive together) and slow down to this.
_FIRST_POLL_S = 0.0005
_LAST_POLL_S = 0.05
_STOPPING_WAIT_S = 3.0

_session_key = pytest.StashKey["LaunchedSession"]()


def auto_backend(launch: Launch) -> str:
    """nccl where this rank has its GPU (cuda:LOCAL_RANK), gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() > launch.local_rank:
        return "nccl"
    return "gloo"


def session_of(config: pytest.Config) -> LaunchedSession | None:
    return config.stash.get(_session_key, None)


def start(config: pytest.Config, launch: Launch, backend: str) -> LaunchedSession:
    session = LaunchedSession(config, launch, backend)
    config.stash[_session_key] = session
    if launch.rank != 0:
        _quiet(config)
    return session


class LaunchedSession:
    """This rank's view of the launched session: its store, its group, where it is."""

    def __init__(self, config: pytest.Config, launch: Launch, backend: str) -> None:
        self.config = config
        self.launch = launch
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.backend = backend
        self.store: Any = None
        self.runs = 0  # ranks tests and run_on_ranks calls so far: each one's store keys
        self.current = ""  # the node id of the test running now
        self.collected: list[str] = []
        self.done: set[str] = set()
        self.lost: dict[int, str] = {}  # ranks that cannot run another test, and why
        self.stop_reason = ""
        self.final_status: int | None = None
        self.group_timeout_s = GROUP_TIMEOUT_MARGIN_S
        self.hung_in: set[str] = set()  # runs whose outcome this rank's timer published
        self.stopping = False  # the launcher sent SIGTERM: finish the current test, then end
        self.finished = threading.Event()  # the exit status is agreed: the session is over
        self._tick = threading.Event()  # never set: a bounded pause between polls
        self.watch = Watch(self)

    # ---- the store ---------------------------------------------------------------------

    def connect(self) -> None:
        """A client of the launch's store (rank 0 hosts it when no agent does), under a prefix
        of this run and attempt."""
        launch = self.launch
        base = dist.TCPStore(  # type: ignore[attr-defined]
            launch.master_addr,
            launch.master_port,
            world_size=launch.world_size,
            is_master=launch.rank == 0 and not launch.agent_store,
            wait_for_workers=False,
            timeout=timedelta(seconds=AGREE_S),
        )
        self.store = dist.PrefixStore(f"harness/{launch.run_key}", base)  # type: ignore[attr-defined]
        self.put(f"pid/{self.rank}", str(os.getpid()))  # for the report if this rank dies

    def put(self, key: str, value: bytes | str) -> None:
        self.store.set(key, value)

    def wait(self, keys: Sequence[str], seconds: float) -> bool:
        """Whether every key is set within `seconds` (a few once the launcher is stopping
        the job: ranks it already killed will never answer).

        Polls: the store's own timed wait logs a warning each time it times out, and a
        short poll keeps the main thread where Python signal handlers run.
        """
        start = time.monotonic()
        pause = _FIRST_POLL_S
        while not self.store.check(list(keys)):
            waited = time.monotonic() - start
            if waited >= seconds or (self.stopping and waited >= _STOPPING_WAIT_S):
                return False
            self._tick.wait(pause)
            pause = min(pause * 2, _LAST_POLL_S)
        return True

    def gather(self, name: str, value: bytes | str | None, seconds: float) -> list[bytes | None]:
        """Every rank's `value` under `name`, in rank order; None for a rank that did not
        publish within `seconds` (ranks already lost are not waited for). A None `value`
        keeps what this rank published there already."""
        if value is not None:
            self.put(f"{name}/{self.rank}", value)
        keys = [f"{name}/{r}" for r in range(self.world_size)]
        awaited = [k for r, k in enumerate(keys) if r not in self.lost]
        if not self.wait(awaited, seconds):
            pass  # some did not come: they read as None below
        return [self.store.get(k) if self.store.check([k]) else None for k in keys]

    def get(self, key: str, seconds: float) -> bytes | None:
        return self.store.get(key) if self.wait([key], seconds) else None

    # ---- agreements ----------------------------------------------------------------------

    def agree_on_backend(self) -> None:
        """Every rank must use the same backend (GPUs may differ between nodes)."""
        found = self.gather("backend", self.backend, AGREE_S)
        if len(set(found)) > 1:
            each = ", ".join(f"rank {r}: {_text(b)}" for r, b in enumerate(found))
            end_session(
                self,
                f"harness: the launched ranks would use different backends ({each}); give "
                f"every rank the same --rank-backend",
            )

    def agree_on_collection(self, items: Sequence[pytest.Item]) -> None:
        """Every rank must have collected the same tests, in the same order."""
        self.collected = [item.nodeid for item in items]
        found = self.gather("collected", json.dumps(self.collected), AGREE_S)
        mine = self.collected
        differences = []
        for r, blob in enumerate(found):
            if blob is None:
                differences.append(f"rank {r} did not finish collecting within {AGREE_S:g} s")
                continue
            theirs = json.loads(blob)
            if theirs != mine:
                differences.append(_collection_difference(r, theirs, self.rank, mine))
        if differences:
            end_session(
                self,
                f"harness: the launched ranks collected different tests: {'; '.join(differences)}"
                f". Every rank must collect the same tests: make collection independent of the "
                f"node (its GPUs, files, environment) or select the same tests everywhere",
            )

    # ---- the process group ---------------------------------------------------------------

    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", self.launch.local_rank)
        return torch.device("cpu")

    def agree_on_group(self, key: str, seconds: float) -> bool:
        """Every rank on one live group for run `key`: if any rank has none (a test destroyed
        it, a plain test set it aside), every rank sets a new one up, under this run's keys.
        False when a rank did not come within `seconds`."""
        need = "1" if not dist.is_initialized() else "0"
        found = self.gather(f"{key}/group", need, seconds)
        if any(flag is None for flag in found):
            return False
        if any(flag == b"1" for flag in found):
            self.drop_group()
            self._init_group(dist.PrefixStore(f"{key}/group", self.store))  # type: ignore[attr-defined]
        return True

    def _init_group(self, store: Any) -> None:
        kwargs: dict[str, Any] = {}
        if self.backend == "nccl":
            torch.cuda.set_device(self.device())
            kwargs["device_id"] = self.device()
        dist.init_process_group(
            self.backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.group_timeout_s),
            **kwargs,
        )

    def drop_group(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    # ---- outcomes and the end ------------------------------------------------------------

    def begin(self, nodeid: str) -> None:
        """A test starts here (whether it will run, skip or fail)."""
        self.current = nodeid
        self.done.add(nodeid)

    def next_run(self) -> str:
        """The store keys' prefix for the next test or call, the same on every rank."""
        self.runs += 1
        return f"run{self.runs}"

    def note_death(self, text: str) -> None:
        """Say, before this process dies of something the harness knows, what it was."""
        with contextlib.suppress(Exception):
            self.put(f"died/{self.rank}", text)

    def exchange(self, key: str, outcome: RankOutcome, seconds: float) -> list[RankOutcome]:
        """Every rank's outcome of run `key`; a rank that published none reads as lost."""
        mine = None if key in self.hung_in else pickle.dumps(outcome)  # the timer's stands
        found = self.gather(f"{key}/outcome", mine, seconds)
        return [
            pickle.loads(blob) if blob is not None else self._missing(key, r, seconds)
            for r, blob in enumerate(found)
        ]

    def _missing(self, key: str, rank: int, seconds: float) -> RankOutcome:
        died = self.store.get(f"died/{rank}") if self.store.check([f"died/{rank}"]) else None
        why = (
            f"it died: {_text(died)}"
            if died is not None
            else f"it gave no outcome within {seconds:g} s: its process ended or cannot run "
            f"Python (the launcher's summary names its exit)"
        )
        self.lost[rank] = why
        pid = self.store.get(f"pid/{rank}") if self.store.check([f"pid/{rank}"]) else b"0"
        outcome = RankOutcome(key, rank, int(pid), Ending.HARD_EXIT, at=time.monotonic())
        outcome.notes.append(f"rank {rank} left the session: {why}")
        return outcome

    def stop(self, reason: str, session: pytest.Session) -> None:
        """End the session after the current test: a rank cannot go on."""
        self.stop_reason = reason
        session.shouldfail = reason  # as -x does: the exit status says tests failed

    def not_run(self) -> list[str]:
        return [nodeid for nodeid in self.collected if nodeid not in self.done]

    def agree_on_exit(self, session: pytest.Session) -> None:
        """Every rank ends with one status: rank 0's, or the worst any rank reached."""
        status = int(session.exitstatus)
        mine = {"status": status, "failed": _failed(session)}
        found = self.gather("status", json.dumps(mine), AGREE_S)
        if self.rank == 0:
            final = self._final(found, mine, session)
            self.put("final", str(final))
        else:
            blob = self.get("final", AGREE_S)
            if blob is None:
                loud(
                    self.config,
                    f"harness: rank {self.rank} could not learn rank 0's exit status within "
                    f"{AGREE_S:g} s; it exits with its own ({status})",
                )
                final = status
            else:
                final = int(blob)
        session.exitstatus = final
        self.over(final)

    def over(self, status: int) -> None:
        """The session's end is agreed: from here this process exits with `status` on its own.

        With failures the launcher stops the job when the first rank exits; the others are
        past every report by then, so the launcher's SIGTERM is ignored from here (it would
        otherwise land in interpreter shutdown and end the rank as killed).
        """
        self.final_status = status
        self.finished.set()
        with contextlib.suppress(ValueError):  # not the main thread: the handler still exits
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _final(
        self, found: list[bytes | None], mine: dict[str, Any], session: pytest.Session
    ) -> int:
        statuses = [mine["status"]]
        for r, blob in enumerate(found):
            if blob is None or r == 0:
                continue
            theirs = json.loads(blob)
            statuses.append(theirs["status"])
            extra = sorted(set(theirs["failed"]) - set(mine["failed"]))
            if extra:
                loud(
                    self.config,
                    f"harness: rank {r} failed where rank 0 did not: {', '.join(extra)}",
                )
        if self.lost:
            statuses.append(int(pytest.ExitCode.TESTS_FAILED))
        bad = [s for s in statuses if s != 0]
        return mine["status"] if mine["status"] != 0 else (bad[0] if bad else 0)


def end_session(session: LaunchedSession, message: str) -> None:
    """Stop the whole session now, on every rank alike (each rank finds the same problem)."""
    session.over(int(pytest.ExitCode.INTERRUPTED))
    raise pytest.exit(message, returncode=pytest.ExitCode.INTERRUPTED)


def _collection_difference(rank: int, theirs: list[str], me: int, mine: list[str]) -> str:
    extra = [n for n in theirs if n not in set(mine)]
    missing = [n for n in mine if n not in set(theirs)]
    parts = []
    if extra:
        parts.append(f"{len(extra)} test(s) rank {me} did not ({', '.join(extra[:5])})")
    if missing:
        parts.append(f"not {len(missing)} test(s) rank {me} did ({', '.join(missing[:5])})")
    if not parts:
        parts.append(f"the same tests in another order than rank {me}")
    return f"rank {rank} collected {' and '.join(parts)}"


def _failed(session: pytest.Session) -> list[str]:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return []
    reports = reporter.stats.get("failed", []) + reporter.stats.get("error", [])
    return sorted({getattr(r, "nodeid", "") for r in reports})


def _text(blob: bytes | None) -> str:
    return "nothing" if blob is None else blob.decode(errors="replace")


# ---- quiet ranks and loud words -----------------------------------------------------------


def _quiet(config: pytest.Config) -> None:
    """Ranks other than 0 print no report and write no junit or cache: rank 0 speaks for all."""
    from _pytest._io import TerminalWriter

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter._tw = TerminalWriter(open(os.devnull, "w"))  # noqa: SIM115 - the session's
    with contextlib.suppress(ImportError):
        from _pytest.junitxml import xml_key

        xml = config.stash.get(xml_key, None)
        if xml is not None:
            del config.stash[xml_key]
            config.pluginmanager.unregister(xml)
    cache = getattr(config, "cache", None)
    if cache is not None:
        with contextlib.suppress(Exception):
            cache.set = lambda key, value: None  # rank 0 writes --lf's record, once


def loud(config: pytest.Config, text: str) -> None:
    """Write to the real terminal (past pytest's capture), whichever rank this is."""
    capman: Any = config.pluginmanager.getplugin("capturemanager")
    capturing = getattr(capman, "_global_capturing", None)
    err = getattr(capturing, "err", None)
    fd = getattr(err, "targetfd_save", 2)
    with contextlib.suppress(OSError):
        os.write(fd, (text.rstrip("\n") + "\n").encode(errors="replace"))
