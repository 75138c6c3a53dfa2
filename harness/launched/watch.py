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
from typing import Any, Protocol

from harness.common.outcome import Ending, RankOutcome
from harness.common.report_text import failure_text
from harness.common.stacks import trim_in_process
from harness.launched.deadlines import Deadlines
from harness.launched.exchange import OutcomeExchange
from harness.launched.fate import Fate
from harness.launched.link import Link
from harness.launched.nodes import Nodes
from harness.launched.position import Position
from harness.launched.store import HEARTBEAT_S, main_thread_in_torch_distributed
from harness.launched.voice import Voice

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


class HangTimer:
    """Fires at a test's deadline on this rank and hands the hang to the session's Watch (the
    Watch's one deadline thread keeps every test's: no thread started per test)."""

    def __init__(self, watch: Watch, key: str, timeout_s: float, where: Where) -> None:
        self._watch, self._key, self._timeout_s, self._where = watch, key, timeout_s, where
        self._token: int | None = None

    def __enter__(self) -> HangTimer:
        self._token = self._watch.deadlines.add(self._timeout_s, self.expired, "harness-hang-timer")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            self._watch.deadlines.withdraw(self._token)

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


class Watched(Protocol):
    """What the Watch sees of its launched session: where this rank is, whether the session
    is over, and the few things the watch asks of it (it changes nothing in it itself)."""

    rank: int
    fate: Fate  # its `finished` and `final_status`: the exit status, once agreed
    position: Position  # where this rank is: the test running now, those not run yet
    nodes: Nodes  # which node each rank runs on
    voice: Voice  # who speaks, and where

    @property
    def connected(self) -> bool: ...

    @property
    def link(self) -> Link:
        """The line to the launch's store (once connected)."""
        ...

    @property
    def outcomes(self) -> OutcomeExchange:
        """Every rank's outcome of a run: this rank's hang published, its own outcome read."""
        ...

    def launcher_stopped(self) -> bool:
        """Note that the launcher is stopping the job; False when it was noted already or
        the session is not connected."""
        ...

    def stop_report(self, wait_s: float) -> str:
        """Rank 0's words on a job the launcher stopped: which ranks ended first, and why."""
        ...

    def look_for_crashes(self) -> None:
        """Name a rank beside this one that died of a fatal signal (each heartbeat)."""
        ...


class Watch:
    """One per launched session: the hang and launcher-stop paths, each taken at most once."""

    def __init__(self, session: Watched) -> None:
        self._session = session
        self.deadlines = Deadlines()  # every test's bound, on one thread
        self._once = threading.Lock()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

    # ---- a hang --------------------------------------------------------------------------

    def hung(self, key: str, timeout_s: float, where: str, note: str = "") -> None:
        session = self._session
        note = note or f"still running at the test's timeout ({timeout_s:g} s)"
        outcome = RankOutcome(
            key,
            session.rank,
            os.getpid(),
            Ending.HUNG,
            at=time.monotonic(),
            stack=_stacks(),
            where=where,
            notes=(note,),
        )
        hung_at = time.time()
        session.outcomes.publish_hang(key, outcome)
        said = self._every_word(key)  # now, while every peer that returned is still here
        if not self._reports():
            with contextlib.suppress(Exception):
                nodeid = session.position.current or ""
                session.voice.last_words(session.link, session.nodes, nodeid, said, hung_at)
            os._exit(1)  # frees every peer blocked on this rank; the launcher stops the job
        self._finish_or_report(f"rank {session.rank} hung in {session.position.current}", key)

    def _every_word(self, key: str) -> str:
        """The verdict on run `key` as this hung rank sees it, from every rank's word (a few
        seconds at most): what its node's terminal and torchrun's error file will say if it
        does not report (a peer hung too, a node lost), where it would otherwise say nothing."""
        session = self._session
        try:
            outcomes = session.outcomes.exchange(
                key, session.outcomes.own_outcome(key), STOPPED_WAIT_S
            )
        except Exception:
            return f"rank {session.rank} hung"
        return failure_text(outcomes) or f"rank {session.rank} hung"

    # ---- signs of life -------------------------------------------------------------------

    def start_heartbeat(self, peers: Any) -> None:
        """Tell the others, every HEARTBEAT_S, that this process is alive (from a thread: it
        goes on while the main thread is blocked in a collective)."""

        def beat() -> None:
            while not self._session.fate.finished.wait(HEARTBEAT_S):
                with contextlib.suppress(Exception):
                    peers.beat()
                    peers.flush_drops()
                with contextlib.suppress(Exception):
                    self._session.look_for_crashes()

        peers.beat()
        threading.Thread(target=beat, name="harness-heartbeat", daemon=True).start()

    # ---- the launcher's SIGTERM --------------------------------------------------------

    def catch_sigterm(self) -> None:
        """Catch SIGTERM; a thread reads the wake-up fd, since the main thread may be blocked
        in a collective or a store wait where no Python handler runs."""
        signal.signal(signal.SIGTERM, self._handler)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._read, name="harness-launcher-stop", daemon=True).start()

    def catch_sigterm_again(self) -> None:
        """After a test that took SIGTERM or the wake-up fd (asyncio does) for itself."""
        if signal.getsignal(signal.SIGTERM) != self._handler:
            signal.signal(signal.SIGTERM, self._handler)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def _handler(self, signum: int, frame: Any) -> None:
        if self._session.fate.final_status is not None:  # past every report: end as agreed
            os._exit(self._session.fate.final_status)
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
        if session.fate.final_status is not None:
            os._exit(session.fate.final_status)
        if not session.launcher_stopped():  # noted: waits end soon, the main thread stops
            return
        self._finish_or_report("the launcher stopped the job", None)

    # ---- the end -----------------------------------------------------------------------

    def _finish_or_report(self, why: str, hung_key: str | None) -> None:
        """Let the main thread end the session; if it cannot, report (rank 0) and exit."""
        session = self._session
        if session.fate.finished.wait(FINISH_GRACE_S):
            return
        if not self._once.acquire(blocking=False):
            return
        if session.fate.final_status is not None:
            os._exit(session.fate.final_status)
        if self._reports():
            with contextlib.suppress(Exception):
                self._report(why, hung_key)
        elif hung_key is None:  # each node says what it saw of the job's end
            with contextlib.suppress(Exception):
                said = self._text(hung_key).split("- ", 1)[-1]
                session.voice.tell_node(session.nodes, session.position.current or "", said)
        os._exit(1)

    def _text(self, hung_key: str | None) -> str:
        session = self._session
        if hung_key is None:
            return session.stop_report(STOPPED_WAIT_S)
        outcomes = session.outcomes.exchange(
            hung_key, session.outcomes.own_outcome(hung_key), STOPPED_WAIT_S
        )
        text = failure_text(outcomes) or "every rank returned"
        return (
            f"FAILED {session.position.current} (reported by rank {session.rank}'s timer)\n{text}"
        )

    def _report(self, why: str, hung_key: str | None) -> None:
        session = self._session
        rank = session.rank
        text = self._text(hung_key)
        session.voice.say(text)
        left = [n for n in session.position.not_run() if n != session.position.current]
        listed = "\n".join(f"  {n}" for n in left) or "  (none)"
        session.voice.say(
            f"harness: the session ended early ({why}; rank {rank} could not finish it, so "
            f"there is no junit xml). Tests not run ({len(left)}):\n{listed}"
        )
        with contextlib.suppress(Exception):
            session.voice.end_early(session.link, session.position.current, text)

    def _reports(self) -> bool:
        """Whether this rank prints the session's reports (rank 0, or one speaking for it)."""
        session = self._session
        peers = session.link.peers if session.connected else None
        return session.voice.reports(session.fate, session.nodes, peers)


def _stacks() -> str:
    """Every thread's Python stack, also of a thread blocked in a C++ collective, from the
    test's frames up."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read()
    here = os.path.dirname(__file__)
    own = (
        "session.py",
        "store.py",
        "link.py",
        "exchange.py",
    )  # the harness's waits, not the test's
    quiet = (__file__, *(os.path.join(here, name) for name in own))
    return trim_in_process(text, os.path.join(here, "body.py"), quiet)
