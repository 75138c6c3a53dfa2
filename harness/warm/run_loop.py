"""The pytest side of one run on warm ranks: send each rank its task, wait for every rank's
end within the run's bound, and decide what each ending means.

Its policies live here: the grace a failure's peers get, the collectives compared as they
go, returned ranks giving a kept group up when a peer lags, a hang's stacks, whether each
rank stays after a failure. It works on anything shaped like a rank process (RankSlot), so
its decisions are tested without processes (tests/harness/test_run_loop.py).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing.connection
import os
import pickle
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harness.common.hygiene import UNDONE
from harness.common.outcome import Ending, RankOutcome, outcome_from_exitcode
from harness.common.protocol import DropGroup, Kind, Message, RankFiles, RunTask
from harness.common.rank_state import RankState
from harness.common.stacks import crash_stack, dump_stacks
from harness.seam import Cut
from harness.warm import collective_match
from harness.warm.live_output import BOUND_POLL_S, LIVE_POLL_S, RunOutput, tail

# After one rank fails, how long its peers get to finish before they count as hung. gloo
# peers fail within milliseconds once the failing rank tears its group down.
FAILURE_GRACE_S = 5.0
TEST_FAILURE_GRACE = "_HARNESS_TEST_FAILURE_GRACE_S"  # the harness's own tests shorten it


def failure_grace_s() -> float:
    """How long peers of a failure get to finish (FAILURE_GRACE_S, unless a test shortens it)."""
    return float(os.environ.get(TEST_FAILURE_GRACE, FAILURE_GRACE_S))


HELD_GROUP = (
    "ended after the test: something still holds its torn-down process group (a subgroup "
    "or DeviceMesh kept in a cache, say), whose sockets only the process's end closes"
)
# How long a rank may take to say it stays after a failure or a dropped group: a safety net
# above its own bounds on the check (group_release.OWN_GROUP_RELEASE_WAIT_S, then garbage
# collection). It says so in milliseconds; only a rank stuck in the check waits it out.
SETTLE_S = 90.0


class RankSlot(Protocol):
    """What the loop needs of one rank process: its pipe, its process's sentinel and exit
    status, the files it writes, and its operations board."""

    rank: int
    pid: int
    files: RankFiles
    conn: Any  # a multiprocessing Connection
    process: Any  # .sentinel, .join(timeout), .exitcode

    def empty_output(self) -> None: ...
    def clear_board(self) -> None: ...
    def read_issued(self) -> int: ...
    def collectives_called(self) -> int: ...
    def read_collectives(self) -> tuple[int, dict[int, str]]: ...
    def read_where(self) -> str: ...


@dataclass(frozen=True)
class RunEnd:
    """How a run ended: every rank's outcome in rank order, and whether a rank is suspect
    (dead, hung, or holding what the next test must not meet): the pool must close; each
    rank's state (its kept group, for the pools to reuse or not)."""

    outcomes: list[RankOutcome]
    must_close: bool
    states: list[RankState] = field(default_factory=list)


class RunLoop:
    """The pytest side of one run: send, wait for every rank within the deadline, classify.

    It decides, and never acts on its owner: `collect` returns every rank's outcome and
    whether the pool must close (a rank is suspect), and the pool closes itself.
    """

    def __init__(
        self,
        slots: Sequence[RankSlot],
        tasks: list[RunTask],
        live: RunOutput,
        cut: Cut | None = None,
        dump: Callable[[dict[int, tuple[int, Path]]], dict[int, str]] = dump_stacks,
    ) -> None:
        self._live = live
        self.slots = list(slots)
        self.tasks = tasks
        self.key = tasks[0].key
        self.timeout_s = tasks[0].spec.timeout_s
        self.outcomes: dict[int, RankOutcome] = {}
        self.states: dict[int, RankState] = {}  # what each rank that answered holds after it
        self.first_failure_at: float | None = None
        # When the first rank ended in a way the test did not declare: its peers then get
        # FAILURE_GRACE_S to finish. An ending the test expects (expect(rank=0, does=...)),
        # a skip or an xfail leaves them the whole timeout.
        self.grace_from: float | None = None
        self._expected = tasks[0].spec.expected
        self._grace_s = failure_grace_s()
        self._cut = cut  # the caller may end the run early (harness.spawn's join=False runs)
        self._dump = dump  # the stuck ranks' stacks, by rank
        # Every rank's pipe and process sentinel, polled for the whole run: a selector made
        # per wait (multiprocessing.connection.wait) registers them all again every time.
        self._poll = select.poll()
        self._watched: dict[int, tuple[RankSlot, bool]] = {}  # fd -> (slot, is its pipe)
        self._to_settle: set[int] = set()  # ranks that say whether they stay (Kind.SETTLED)
        self._compared = 0  # collectives every rank had called, when last compared
        self._mismatch_found: collective_match.Mismatch | None = None

    def collect(self) -> RunEnd:
        start = time.monotonic()
        for slot in self.slots:
            self._watch(slot)
            slot.empty_output()
            slot.clear_board()
        for slot, task in zip(self.slots, self.tasks, strict=False):
            try:  # plain pickle: a task needs none of ForkingPickler's reducers
                slot.conn.send_bytes(pickle.dumps(Message(Kind.RUN, task), pickle.HIGHEST_PROTOCOL))
            except OSError:  # BrokenPipeError included: the rank is already dead
                self._record_death(slot)
        deadline = start + self.timeout_s
        while len(self.outcomes) < len(self.slots):
            cut_at = None if self._cut is None else self._cut.at
            limit = deadline if cut_at is None else min(deadline, cut_at)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                self._handle_hang(self._cut if cut_at is not None and cut_at < deadline else None)
                break
            grace_left = self._end_peers_waiting_on_the_ended()
            self._wait_once(min(remaining, grace_left, self._poll_s()))
            self._live.drain()
            self._drop_kept_groups_if_peers_lag()
            self._fail_on_a_mismatch()
        self._live.drain(final=True)
        self._name_a_mismatch()
        for slot in self.slots:
            self.outcomes[slot.rank] = self.outcomes[slot.rank].with_output(
                self._live.report(slot.files.stdout),
                self._live.report(slot.files.stderr),
                tail(slot.files.log).rstrip("\n"),
            )
        # A rank with a thread of the test's still running is not clean for the next test.
        suspect = any(
            o.ending in _NOT_REUSABLE or {"threads", UNDONE} & o.leftovers.keys() or o.replace_after
            for o in self.outcomes.values()
        )
        if not suspect and not self._all_stay():
            suspect = True  # a rank ends (a group it cannot drop), or never said: replaced
        return RunEnd(
            [self.outcomes[slot.rank] for slot in self.slots],
            must_close=suspect,
            states=[self.states.get(slot.rank, RankState()) for slot in self.slots],
        )

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
            self.outcomes[rank] = outcome.replaced(why)

    def _poll_s(self) -> float:
        """How long one wait may block: short while output streams live or a run is on the
        harness's group (its kept groups and collectives are watched)."""
        # On the harness's group, the ranks' collectives are compared as they go: a rank
        # blocked in one its peers called differently gives no other sign.
        cuttable = self.tasks[0].spec.bare  # a run without a group (harness.spawn's may be cut)
        watched = self._live.enabled or self._on_harness_group or cuttable
        return LIVE_POLL_S if watched else BOUND_POLL_S  # the output files' sizes are watched

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
        kept = self._keeping()
        if not kept or len(self.outcomes) == len(self.slots):
            return
        if self.first_failure_at is None and not self._a_peer_waits_on(kept):
            return
        for rank in kept:
            self._give_group_up(rank)

    def _keeping(self) -> list[int]:
        """The ranks that kept their group for the next test (so far)."""
        return [rank for rank, state in self.states.items() if state.kept_group]

    def _give_group_up(self, rank: int) -> None:
        """Tell a rank that kept its group to tear it down; it then says whether it stays."""
        self.states[rank].give_group_up()
        slot = next(s for s in self.slots if s.rank == rank)
        with contextlib.suppress(OSError):
            slot.conn.send(Message(Kind.DROP_GROUP, DropGroup(self.key)))
            self._to_settle.add(rank)

    def _a_peer_waits_on(self, returned: list[int]) -> bool:
        """Whether a rank still running has issued an operation no rank of `returned` will
        match, or the ranks called a collective differently (one may wait for good)."""
        done = set(returned)
        if any(self._issued_past(s, done) for s in self._pending()):
            return True
        return self._mismatch() is not None

    def _issued_past(self, slot: RankSlot, ranks: set[int]) -> bool:
        """Whether `slot` issued more operations on the group than one of `ranks` did (it
        waits on that rank for an operation it never issued)."""
        counts = [s.read_issued() for s in self.slots if s.rank in ranks]
        return bool(counts) and slot.read_issued() > min(counts)

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
        self._mismatch_found = collective_match.first_mismatch(boards, since=self._compared)
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
        for rank in mismatch.odd:  # its group is never reused: the pools see it kept none
            if rank in self.states:
                self.states[rank].give_group_up()
        for rank in self._keeping():
            self._give_group_up(rank)

    def _pending(self) -> list[RankSlot]:
        return [s for s in self.slots if s.rank not in self.outcomes]

    def _watch(self, slot: RankSlot) -> None:
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

    def _receive(self, slot: RankSlot) -> None:
        try:
            message = slot.conn.recv()
        except (EOFError, OSError):
            self._record_death(slot)
            return
        if message.kind is not Kind.RESULT or message.payload.outcome.key != self.key:
            return  # a late answer to an earlier run is never credited to this one
        outcome, state = message.payload.outcome, message.payload.state
        self.states[outcome.rank] = state
        self._record(outcome)
        if outcome.ending is not Ending.RETURNED or state.settles:
            self._to_settle.add(outcome.rank)  # it checks its torn-down group, then says

    def _record_death(self, slot: RankSlot) -> None:
        slot.process.join(timeout=5)
        outcome = outcome_from_exitcode(
            self.key, slot.rank, slot.pid, slot.process.exitcode, time.monotonic()
        )
        if outcome.ending is Ending.SIGNALLED:
            outcome = outcome.with_traceback(crash_stack(slot.files.crash))  # where it crashed
        self._record(outcome)

    def _record(self, outcome: RankOutcome) -> None:
        self.outcomes[outcome.rank] = outcome
        self._unwatch(outcome.rank)
        if not outcome.ok and self.first_failure_at is None:
            self.first_failure_at = time.monotonic()
        if self.grace_from is None and self._unexpected(outcome):
            self.grace_from = time.monotonic()

    def _end_peers_waiting_on_the_ended(self) -> float:
        """Once the failure grace is over, end as hung the ranks still running that wait on
        a rank that has ended (they are in a labelled collective, or issued an operation on
        the harness's group that it never matched): they could only wait for good. A rank
        with no such sign may still end on its own, with its own ending: it is waited for up
        to the test's timeout, so no time decides a verdict. Returns how long until the grace
        is over (inf when it is, or no rank failed)."""
        if self.grace_from is None:
            return math.inf
        left = self.grace_from + self._grace_s - time.monotonic()
        if left > 0:
            return left
        waiting = [s for s in self._pending() if self._waits_on_an_ended_rank(s)]
        if waiting:
            self._end_as_hung(waiting, after_failure=True)
        return math.inf

    def _waits_on_an_ended_rank(self, slot: RankSlot) -> bool:
        if slot.read_where():
            return True  # a labelled collective needs every rank of its group
        if not self._on_harness_group:
            return False  # the test's own group: its operations are not counted
        # A collective the ranks called differently may never complete.
        return self._issued_past(slot, set(self.outcomes)) or self._mismatch() is not None

    def _unexpected(self, outcome: RankOutcome) -> bool:
        if outcome.ending in (Ending.SKIPPED, Ending.XFAILED):
            return False
        if self._expected:
            return not self._expected[outcome.rank].matches(outcome)
        return not outcome.ok

    def _handle_hang(self, cut: Cut | None = None) -> None:
        """At the run's bound (its timeout, or `cut`: when, and why), the ranks still
        running are hung; those waiting on an ended rank hung because a peer failed."""
        stuck = self._pending()
        waiting = [
            s for s in stuck if self.grace_from is not None and self._waits_on_an_ended_rank(s)
        ]
        self._end_as_hung(waiting, after_failure=True, cut=cut)
        self._end_as_hung(self._pending(), after_failure=False, cut=cut)

    def _end_as_hung(
        self, stuck: list[RankSlot], after_failure: bool, cut: Cut | None = None
    ) -> None:
        """Record `stuck` as hung, with their Python stacks; `collect` then closes the pool,
        which kills them."""
        if not stuck:
            return
        stacks = self._dump({s.rank: (s.pid, s.files.stacks) for s in stuck})
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
                after_failure=after_failure,
                notes=(self._hang_note(now, after_failure, cut),),
            )
            self.outcomes[slot.rank] = outcome
            self._unwatch(slot.rank)

    def _hang_note(self, now: float, after_failure: bool, cut: Cut | None) -> str:
        if cut is not None:
            return f"still running {now - cut.asked_at:.1f} s after {cut.why}; killed"
        if after_failure and self.grace_from is not None:
            waited = now - self.grace_from
            return f"still running {waited:.1f} s after a peer failed, waiting on it; killed"
        return f"still running at the {self.timeout_s:g} s timeout; killed"


_NOT_REUSABLE = (Ending.HARD_EXIT, Ending.SIGNALLED, Ending.HUNG)
