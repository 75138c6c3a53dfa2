"""What a launched rank does when it cannot finish a test: a hang, or the launcher stopping
the job (a rank died, or the job was cancelled).

In-process ranks cannot be killed and replaced as a pool's workers are, so both end the
session. A hung rank other than 0 publishes its stacks as its outcome and exits, which frees
the peers blocked on it; the launcher then stops the job and gives every process a grace
period, in which the main threads that can still move finish the test and the session as
usual (rank 0's report, junit, one exit status). Where rank 0's main thread cannot move, this
module reports from a thread, past pytest's capture, and exits.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from harness.common.outcome import Ending, RankOutcome, failure_text, ranks_phrase
from harness.launched import records, terminal
from harness.launched.store import HEARTBEAT_S, main_thread_in_torch_distributed
from harness.stacks import trim_in_process

if TYPE_CHECKING:
    from harness.launched.session import LaunchedSession
    from harness.launched.store import Peers

# How long a stopped or hung rank gives its main thread to finish the session on its own
# (torchrun allows 30 s between its SIGTERM and its SIGKILL).
FINISH_GRACE_S = 15.0
# How long rank 0, reporting on its own, waits for the others to say they were stopped
# (the ones that say nothing are the ones that died).
STOPPED_WAIT_S = 3.0


class Where:
    """The rankwise labelled collectives this rank is in, for a hang's report."""

    def __init__(self) -> None:
        self.stack: list[str] = []

    def observe(self, phase: str, kind: str, label: str) -> None:
        if phase == "enter":
            self.stack.append(f"{kind}({label!r})")
        elif self.stack:
            self.stack.pop()

    @contextlib.contextmanager
    def installed(self) -> Iterator[Where]:
        from harness.common.faults import rankwise_points

        points = rankwise_points()
        if points is not None:
            points.add_observer(self.observe)
        try:
            yield self
        finally:
            if points is not None:
                points.remove_observer(self.observe)


class _Timer:
    """A thread that calls `expired` once `timeout_s` pass before the block it bounds ends."""

    name = "harness-timer"

    def __init__(self, watch: Watch, key: str, timeout_s: float) -> None:
        self._watch, self._key, self._timeout_s = watch, key, timeout_s
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def __enter__(self) -> _Timer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finished.set()

    def _run(self) -> None:
        if not self._finished.wait(self._timeout_s):
            self.expired()

    def expired(self) -> None:
        raise NotImplementedError


class HangTimer(_Timer):
    """Fires at a test's deadline on this rank and hands the hang to the session's Watch."""

    name = "harness-hang-timer"

    def __init__(self, watch: Watch, key: str, timeout_s: float, where: Where) -> None:
        super().__init__(watch, key, timeout_s)
        self._where = where

    def expired(self) -> None:
        self._watch.hung(self._key, self._timeout_s, " > ".join(self._where.stack))


class FixtureTimer(_Timer):
    """pytest-timeout's bound for a test's fixtures on a launched rank (set-up or teardown).

    pytest-timeout's SIGALRM handler runs only once the main thread is back in Python: a
    fixture blocked in a collective would wait for the group's own, far longer, bound. At
    pytest-timeout's bound, a rank whose main thread is inside torch.distributed reports the
    hang with its stacks, as a body's hang is reported, and the session ends there (an
    in-process rank cannot be replaced); anywhere else pytest-timeout acts as it does.
    """

    name = "harness-fixture-timer"

    def __init__(self, watch: Watch, key: str, timeout_s: float, phase: str) -> None:
        super().__init__(watch, key, timeout_s)
        self._phase = phase

    def expired(self) -> None:
        if not main_thread_in_torch_distributed():
            return
        note = (
            f"still running at pytest-timeout's bound ({self._timeout_s:g} s), in the "
            f"{self._phase} of its fixtures, blocked in torch.distributed (where "
            f"pytest-timeout's signal cannot interrupt it)"
        )
        self._watch.hung(self._key, self._timeout_s, f"{self._phase} of the fixtures", note)


class Watch:
    """One per launched session: the hang and launcher-stop paths, each taken at most once."""

    def __init__(self, session: LaunchedSession) -> None:
        self._session = session
        self._once = threading.Lock()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

    # ---- a hang --------------------------------------------------------------------------

    def hung(self, key: str, timeout_s: float, where: str, note: str = "") -> None:
        session = self._session
        outcome = RankOutcome(key, session.rank, os.getpid(), Ending.HUNG, at=time.monotonic())
        outcome.stack, outcome.where = _stacks(), where
        outcome.notes.append(note or f"still running at the test's timeout ({timeout_s:g} s)")
        session.hung_in.add(key)  # the main thread, if it comes back, keeps this outcome
        session.put(f"{key}/outcome/{session.rank}", records.encode_outcome(outcome))
        if session.rank != 0:
            _exit(session, 1)  # frees every peer blocked on this rank; the launcher stops the job
        self._finish_or_report(f"rank 0 hung in {session.current}", key)

    # ---- signs of life -------------------------------------------------------------------

    def start_heartbeat(self, peers: Peers) -> None:
        """Tell the others, every HEARTBEAT_S, that this process is alive (from a thread: it
        goes on while the main thread is blocked in a collective)."""

        def beat() -> None:
            while not self._session.finished.wait(HEARTBEAT_S):
                with contextlib.suppress(Exception):
                    peers.beat()

        peers.beat()
        threading.Thread(target=beat, name="harness-heartbeat", daemon=True).start()

    # ---- the launcher's SIGTERM --------------------------------------------------------

    def install(self) -> None:
        """Catch SIGTERM; a thread reads the wake-up fd, since the main thread may be blocked
        in a collective or a store wait where no Python handler runs."""
        signal.signal(signal.SIGTERM, self._handler)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._read, name="harness-launcher-stop", daemon=True).start()

    def reinstall(self) -> None:
        """After a test that took SIGTERM or the wake-up fd (asyncio does) for itself."""
        if signal.getsignal(signal.SIGTERM) != self._handler:
            signal.signal(signal.SIGTERM, self._handler)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def _handler(self, signum: int, frame: Any) -> None:
        if self._session.final_status is not None:  # past every report: end as agreed
            os._exit(self._session.final_status)
        threading.Thread(target=self._stopped, daemon=True).start()  # never block the main thread

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if signal.SIGTERM in data:
                self._stopped()

    def _stopped(self) -> None:
        session = self._session
        if session.final_status is not None:
            os._exit(session.final_status)
        if session.stopping or session.peers is None:
            return
        session.peers.stopping = True  # waits end soon; the main thread stops after this test
        with contextlib.suppress(Exception):
            session.put(f"stopped/{session.rank}", session.current or "-")
        self._finish_or_report("the launcher stopped the job", None)

    # ---- the end -----------------------------------------------------------------------

    def _finish_or_report(self, why: str, hung_key: str | None) -> None:
        """Let the main thread end the session; if it cannot, report (rank 0) and exit."""
        session = self._session
        if session.finished.wait(FINISH_GRACE_S):
            return
        if not self._once.acquire(blocking=False):
            return
        if session.final_status is not None:
            os._exit(session.final_status)
        if session.rank == 0:
            with contextlib.suppress(Exception):
                self._report(why, hung_key)
        _exit(session, 1)

    def _report(self, why: str, hung_key: str | None) -> None:
        session = self._session
        if hung_key is not None:
            outcomes = session.exchange(hung_key, _own(session, hung_key), STOPPED_WAIT_S)
            text = failure_text(outcomes) or "every rank returned"
            terminal.loud(
                session.config, f"FAILED {session.current} (reported by rank 0's timer)\n{text}"
            )
        else:
            terminal.loud(session.config, _stop_report(session))
        left = [n for n in session.not_run() if n != session.current]
        listed = "\n".join(f"  {n}" for n in left) or "  (none)"
        terminal.loud(
            session.config,
            f"harness: the session ended early ({why}; rank 0 could not finish it, so there "
            f"is no junit xml). Tests not run ({len(left)}):\n{listed}",
        )
        with contextlib.suppress(Exception):
            session.put("final", "1")


def _stop_report(session: LaunchedSession) -> str:
    others = [r for r in range(session.world_size) if r != session.rank]
    session.wait([f"stopped/{r}" for r in others], STOPPED_WAIT_S)
    assert session.peers is not None
    gone = [r for r in others if not session.peers.has(f"stopped/{r}")]
    during = f"during {session.current}" if session.current else "between tests"
    lines = [f"harness: the launcher stopped the job {during}."]
    for r in gone:
        died = f"died/{r}"
        blob = session.peers.read(died) or b"{}"
        try:
            cause = records.read_json(blob, died, {"text": str})["text"] if blob != b"{}" else ""
        except records.RecordError:
            cause = ""  # not the harness's word
        cause = cause or "it left no word (the launcher's summary has its exit status)"
        lines.append(f"  rank {r} ended first: {cause}")
    if gone:
        stopped = [r for r in range(session.world_size) if r not in gone]
        verb = "was" if len(stopped) == 1 else "were"
        lines.append(f"  {ranks_phrase(stopped)} {verb} stopped by the launcher")
    else:
        lines.append("  every rank was stopped by it (a cancelled job, or a rank's own exit)")
    return "\n".join(lines)


def _own(session: LaunchedSession, key: str) -> RankOutcome:
    assert session.peers is not None
    blob = session.peers.read(f"{key}/outcome/{session.rank}") or b""
    return records.decode_outcome(blob, key, session.rank)


def _exit(session: LaunchedSession, status: int) -> None:
    session.final_status = status
    os._exit(status)


def _stacks() -> str:
    """Every thread's Python stack, also of a thread blocked in a C++ collective, from the
    test's frames up."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read()
    here = os.path.dirname(__file__)
    quiet = (__file__, os.path.join(here, "session.py"), os.path.join(here, "store.py"))
    return trim_in_process(text, os.path.join(here, "body.py"), quiet)
