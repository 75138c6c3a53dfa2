"""The verdict's material: :class:`RankOutcome`, the record every rank's end becomes, whatever
ended it (frozen, all the way down: a change is a new record). Which failure was the root
cause is root_cause.py's; the report's words, report_text.py's; reading torch's errors,
diagnosis.py's. What a warm rank keeps for the next test (its group) is not the verdict's:
see rank_state.py.

Imports no torch; the ranks make outcomes (endings.py), the pytest side judges them.
"""

from __future__ import annotations

import enum
import pickle
import signal
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from harness.common import diagnosis


class Ending(enum.Enum):
    """How a rank's run ended."""

    RETURNED = "returned"
    RAISED = "raised"
    EXITED = "exited"  # SystemExit raised in the body; the worker lives on
    SKIPPED = "skipped"  # pytest.skip() in the body
    XFAILED = "xfailed"  # pytest.xfail() in the body
    HARD_EXIT = "hard exit"  # the process ended with an exit status (os._exit, abort paths)
    SIGNALLED = "signalled"  # the process died of a signal
    HUNG = "hung"  # still running at the deadline; stacks dumped, then killed
    # Under a launch: the rank's node went away or was cut off (every rank of it silent, or
    # the launch's store it held gone), so no outcome can arrive; `message` says which node.
    LOST = "lost"


@dataclass(frozen=True)
class RankWarning:
    """A warning a rank recorded (not an error under the test's filters)."""

    category: str  # qualified name, e.g. "builtins.UserWarning"
    message: str
    filename: str
    lineno: int


class Findings(Mapping[str, str]):
    """A rank's hygiene findings, by check: read-only, so that a frozen outcome is frozen all
    the way down (a new finding makes a new outcome: RankOutcome.with_leftover)."""

    __slots__ = ("_by_check",)

    def __init__(self, found: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> None:
        self._by_check: dict[str, str] = dict(found)

    def __getitem__(self, check: str) -> str:
        return self._by_check[check]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_check)

    def __len__(self) -> int:
        return len(self._by_check)

    def __repr__(self) -> str:
        return f"Findings({self._by_check!r})"

    def __reduce__(self) -> tuple[type[Findings], tuple[dict[str, str]]]:
        return (Findings, (dict(self._by_check),))


@dataclass(frozen=True)
class RankOutcome:
    """One rank's end of one run: what it did, when, and what it printed. Built once by the
    process that saw the end (endings.py in a rank; outcome_from_exitcode for a process that
    died without a word); whoever observes more of it (the run loop: the rank's output, a
    crash's stack, a replacement) makes a new one through a typed method below. Frozen, all
    the way down."""

    key: str
    rank: int
    pid: int
    ending: Ending
    at: float = 0.0  # time.monotonic() when the rank ended (system-wide clock)
    value_blob: bytes | None = None
    value_repr: str = ""
    value_lost: str = ""  # why the return value could not be sent back, if it could not
    exc_type: str = ""  # qualified name, e.g. "builtins.ValueError"
    exc_mro: tuple[str, ...] = ()  # class names of the type and its bases
    exc_classes: tuple[str, ...] = ()  # their qualified names ("builtins.ValueError")
    message: str = ""
    traceback: str = ""
    exit_code: int | None = None
    signal: int | None = None
    stack: str = ""  # Python stacks of a hung rank
    where: str = ""  # the labelled collective a hung rank was in, when known
    stdout: str = ""  # what the rank wrote to fd 1 during the run (its tail, if long)
    stderr: str = ""  # what it wrote to fd 2
    log: str = ""  # the log records it captured (RankSpec.log_capture), formatted
    after_failure: bool = False  # hung only because a peer had failed
    notes: tuple[str, ...] = ()
    leftovers: Mapping[str, str] = field(default_factory=Findings)  # hygiene findings, by check
    replace_after: str = ""  # why this rank must not serve another test (it is replaced)
    origin_rank: int | None = None  # the rank a library error says this failure came from
    warnings: tuple[RankWarning, ...] = ()
    skipped_at: tuple[str, int] | None = None  # a skip's (file, line), as pytest reports it
    setup_failed: bool = False  # the harness could not set the group up; the body never ran
    setup_attempts: int = 1  # how many times the harness tried

    def __post_init__(self) -> None:
        if not isinstance(self.leftovers, Findings):  # a plain mapping given: kept read-only
            object.__setattr__(self, "leftovers", Findings(self.leftovers))

    def noted(self, note: str, first: bool = False) -> RankOutcome:
        """This outcome with one more note (`first`: before the others)."""
        return replace(self, notes=(note, *self.notes) if first else (*self.notes, note))

    def with_leftover(self, check: str, finding: str) -> RankOutcome:
        """This outcome with a hygiene finding under `check` (after any already there)."""
        earlier = self.leftovers.get(check, "")
        text = f"{earlier}; {finding}" if earlier else finding
        return replace(self, leftovers={**self.leftovers, check: text})

    def with_findings(
        self, warnings: tuple[RankWarning, ...], leftovers: Mapping[str, str]
    ) -> RankOutcome:
        """What the rank found after its body: the warnings it recorded, what it left."""
        return replace(self, warnings=warnings, leftovers=leftovers)

    def with_output(self, stdout: str, stderr: str, log: str | None = None) -> RankOutcome:
        """What the rank printed (and logged), as the process reading its streams saw it."""
        return replace(self, stdout=stdout, stderr=stderr, log=self.log if log is None else log)

    def with_notes(self, *notes: str) -> RankOutcome:
        """This outcome with `notes` in place of its own (a better account of the same end)."""
        return replace(self, notes=notes)

    def with_traceback(self, traceback: str) -> RankOutcome:
        """Where the rank was: a crash's stack, read from its crash file."""
        return replace(self, traceback=traceback)

    def with_stack(self, stack: str) -> RankOutcome:
        """A hung rank's Python stacks, as shown (importlib's frames folded, say)."""
        return replace(self, stack=stack)

    def replaced(self, why: str) -> RankOutcome:
        """This rank must not serve another test, and why: its process is replaced."""
        return replace(self, replace_after=why)

    def set_up_tried(self, attempts: int, failed: bool | None = None) -> RankOutcome:
        """The harness's set-up of the ranks for this run: how many attempts it took, and
        (`failed`) whether it failed, so that the body never ran."""
        changed = replace(self, setup_attempts=attempts)
        return changed if failed is None else replace(changed, setup_failed=failed)

    def skipped_instead(self, reason: str) -> RankOutcome:
        """This rank's exit read as the skip its test base's exit status stands for (torch's
        TEST_SKIPS)."""
        return replace(self, ending=Ending.SKIPPED, message=reason)

    def raised_instead(
        self, exc_type: str, exc_mro: tuple[str, ...], message: str, at: float
    ) -> RankOutcome:
        """This rank's end read as an error the harness found (its collectives out of step
        with its peers'), at `at`: the rank's own end is kept in a note by the caller."""
        return replace(
            self,
            ending=Ending.RAISED,
            exc_type=exc_type,
            exc_mro=exc_mro,
            exc_classes=(exc_type,),
            message=message,
            origin_rank=None,
            at=at,
        )

    @property
    def output(self) -> str:
        """stdout, then stderr."""
        return self.stdout + self.stderr

    @property
    def ok(self) -> bool:
        return self.ending is Ending.RETURNED

    @property
    def value(self) -> Any:
        """The rank's return value (loaded in the pytest process), or None; ValueError for
        one that could not be sent back (it is not taken for None)."""
        if self.value_lost:
            raise ValueError(
                f"rank {self.rank} returned {self.value_repr} but it could not be sent back to "
                f"the pytest process ({self.value_lost}); return a value that pickles"
            )
        if self.value_blob is None:
            return None
        return pickle.loads(self.value_blob)

    @property
    def exc_name(self) -> str:
        return self.exc_type.rsplit(".", 1)[-1]

    @property
    def in_collective(self) -> str:
        """The collective a hung rank waits in: its rankwise label, else torch's function."""
        return self.where or diagnosis.collective_in_stack(self.stack)

    @property
    def waited_in(self) -> str:
        """The collective this rank was in when it hung or a peer's departure broke it."""
        if self.ending is Ending.HUNG:
            return self.in_collective
        return diagnosis.innermost_collective(self.traceback)

    @property
    def before_exchange(self) -> bool:
        """A hung rank inside a labelled collective but not waiting in torch.distributed (nor
        in rankwise's wait for an async collective, under its peer watch): still in its own
        `fn` (or in a fault injected at the label), so its peers wait on it."""
        waiting = diagnosis.waiting_in_torch(self.stack)
        return bool(self.where) and bool(self.stack) and not waiting

    @property
    def looks_collateral(self) -> bool:
        """Whether this failure reads as caused by a peer going away (or not arriving)."""
        if self.ending is Ending.HUNG:
            return self.after_failure or (bool(self.in_collective) and not self.before_exchange)
        if self.origin_rank is not None:  # rankwise (or an assertion helper) said whose it is
            return self.origin_rank != self.rank
        if self.ending is not Ending.RAISED:
            return False
        return diagnosis.reads_as_peer_gone(
            self.exc_name, self.exc_classes, self.message, self.traceback
        )

    def describe(self) -> str:
        """One phrase: 'raised ValueError: bad', 'died of SIGSEGV', 'hung in all_reduce(...)'."""
        if self.ending is Ending.RETURNED:
            return "returned"
        if self.ending is Ending.RAISED:
            first = self.message.strip().splitlines()[0] if self.message.strip() else ""
            return f"raised {self.exc_name}: {first}" if first else f"raised {self.exc_name}"
        if self.ending is Ending.EXITED:  # sys.exit("text") exits 1, having printed the text
            return (
                f"called sys.exit({self.message!r})"
                if self.message
                else (f"called sys.exit({self.exit_code})")
            )
        if self.ending is Ending.SKIPPED:
            return f"skipped: {self.message}"
        if self.ending is Ending.XFAILED:
            return f"xfailed: {self.message}"
        if self.ending is Ending.HARD_EXIT:
            if self.exit_code is None:
                return "process ended without an outcome"
            return f"process exited with status {self.exit_code}"
        if self.ending is Ending.SIGNALLED:
            return f"died of {signal_name(self.signal)}"
        if self.ending is Ending.LOST:
            return self.message or "lost with its node"
        where = self.in_collective
        if where and self.before_exchange:
            return f"hung in {where}, before its exchange"
        return f"hung in {where}" if where else "hung outside any collective"


def signal_name(signum: int | None) -> str:
    if signum is None:
        return "an unknown signal"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(exc: SystemExit) -> int:
    """The process exit status `exc` stands for: None is 0, a message (printed by Python) is 1."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def outcome_from_exitcode(
    key: str, rank: int, pid: int, exitcode: int | None, at: float
) -> RankOutcome:
    """The outcome of a rank process that ended without reporting a result: its exit status
    as multiprocessing gives it (negative: the signal that killed it)."""
    if exitcode is not None and exitcode < 0:
        return RankOutcome(key, rank, pid, Ending.SIGNALLED, at=at, signal=-exitcode)
    return RankOutcome(key, rank, pid, Ending.HARD_EXIT, at=at, exit_code=exitcode)
