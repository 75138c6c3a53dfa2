"""The verdict's material, read on the pytest side: :class:`RankOutcome` (the record every
rank's end becomes, whatever ended it; frozen: a change is a new record), which failure was
the root cause and which were collateral, and the whole text of a failure report. What a
warm rank keeps for the next test (its group) is not the verdict's: see rank_state.py.

Imports no torch; the ranks make outcomes (endings.py), the pytest side judges them.
"""

from __future__ import annotations

import enum
import pickle
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol


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


# Errors that a rank gets because a peer went away: they are consequences, not causes.
_PEER_ERROR_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
# faulthandler's line for a frame of torch's collective API:
#   File ".../distributed_c10d.py", line 5356 in barrier
# (or of the functional collectives DeviceMesh and DTensor wait in: wait_tensor)
_C10D_FRAME = re.compile(r'(?:distributed_c10d|_functional_collectives)\.py", line \d+ in (\w+)')
# rankwise waiting for an async collective's work (on a launch, through its peer watch).
_RANKWISE_WAIT_FRAME = re.compile(
    r'rankwise/_(?:watch|transport)\.py", line \d+ in (?:wait|settle)'
)
# A traceback's line for the same frame: File ".../distributed_c10d.py", line 5356, in barrier
_C10D_TRACEBACK_FRAME = re.compile(
    r'(?:distributed_c10d|_functional_collectives)\.py", line \d+, in (\w+)'
)
# A traceback's frame in torch.distributed (c10d, functional collectives, FSDP, DTensor).
_TORCH_DISTRIBUTED_FRAME = re.compile(r'File "[^"]*/torch/distributed/')
_PEER_ERROR_TEXT = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"ProcessGroup.*(aborted|destroyed)|communicator was aborted|"
    r"Socket Timeout|Connection refused|peer.*(closed|died|exited)|"
    r"Timed out waiting \d+ms for (recv|send) operation",  # gloo: a peer never came
    re.IGNORECASE,
)

# torch.distributed's words for a rank's own network mistake (a port another socket holds,
# an address not on this host): never a peer's doing, though its error type reads so.
_OWN_NETWORK_ERROR_TEXT = re.compile(
    r"EADDRINUSE|address already in use|EADDRNOTAVAIL|cannot assign requested address",
    re.IGNORECASE,
)


def report_looks_collateral(text: str) -> bool:
    """Whether a pytest failure report (its text alone) reads as a peer going away inside
    torch.distributed, as RankOutcome.looks_collateral judges a rank's exception."""
    if _OWN_NETWORK_ERROR_TEXT.search(text) or "torch/distributed/" not in text:
        return False
    return bool(_PEER_ERROR_TEXT.search(text))


@dataclass(frozen=True)
class RankWarning:
    """A warning a rank recorded (not an error under the test's filters)."""

    category: str  # qualified name, e.g. "builtins.UserWarning"
    message: str
    filename: str
    lineno: int


@dataclass(frozen=True)
class RankOutcome:
    """One rank's end of one run: what it did, when, and what it printed. Frozen: whoever
    learns more of it (the run loop, a verdict's diagnosis) makes a new one (`but`, `noted`)."""

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
    leftovers: Mapping[str, str] = field(default_factory=dict)  # hygiene findings, by check
    replace_after: str = ""  # why this rank must not serve another test (it is replaced)
    origin_rank: int | None = None  # the rank a library error says this failure came from
    warnings: tuple[RankWarning, ...] = ()
    skipped_at: tuple[str, int] | None = None  # a skip's (file, line), as pytest reports it
    setup_failed: bool = False  # the harness could not set the group up; the body never ran
    setup_attempts: int = 1  # how many times the harness tried

    def but(self, **changes: Any) -> RankOutcome:
        """This outcome with `changes` to its fields."""
        return replace(self, **changes)

    def noted(self, note: str, first: bool = False) -> RankOutcome:
        """This outcome with one more note (`first`: before the others)."""
        return replace(self, notes=(note, *self.notes) if first else (*self.notes, note))

    def with_leftover(self, check: str, finding: str) -> RankOutcome:
        """This outcome with a hygiene finding under `check` (after any already there)."""
        earlier = self.leftovers.get(check, "")
        text = f"{earlier}; {finding}" if earlier else finding
        return replace(self, leftovers={**self.leftovers, check: text})

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
        if self.where:
            return self.where
        match = _C10D_FRAME.search(self.stack)
        return match.group(1) if match else ""

    @property
    def waited_in(self) -> str:
        """The collective this rank was in when it hung or a peer's departure broke it."""
        if self.ending is Ending.HUNG:
            return self.in_collective
        found = _C10D_TRACEBACK_FRAME.findall(self.traceback)
        return found[-1] if found else ""  # the innermost: tracebacks list it last

    @property
    def before_exchange(self) -> bool:
        """A hung rank inside a labelled collective but not waiting in torch.distributed (nor
        in rankwise's wait for an async collective, under its peer watch): still in its own
        `fn` (or in a fault injected at the label), so its peers wait on it."""
        waiting = _C10D_FRAME.search(self.stack) or _RANKWISE_WAIT_FRAME.search(self.stack)
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
        if _OWN_NETWORK_ERROR_TEXT.search(self.message):
            return False
        if self.exc_name in _PEER_ERROR_TYPES:
            return True
        # Words like "Connection refused" mean a peer is gone only in torch.distributed's
        # errors: the rank's own sockets and pipes fail with the same words.
        from_torch = _TORCH_DISTRIBUTED_FRAME.search(self.traceback) is not None or any(
            name.startswith("torch.") for name in self.exc_classes
        )
        return from_torch and bool(_PEER_ERROR_TEXT.search(self.message))

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
    """The outcome of a rank process that ended without reporting a result."""
    if exitcode is not None and exitcode < 0:
        return RankOutcome(key, rank, pid, Ending.SIGNALLED, at=at, signal=-exitcode)
    return RankOutcome(key, rank, pid, Ending.HARD_EXIT, at=at, exit_code=exitcode)


@dataclass(frozen=True)
class Diagnosis:
    """Which rank's failure came first and which failures it caused.

    Two cases have no failing root: ranks that `departed` (returned, or tore their group
    down) while the failing ranks waited on them, and ranks hung `out_of_step` (each in a
    different collective, every one waiting for the others).
    """

    root: int | None
    collateral: tuple[int, ...]
    independent: tuple[int, ...]  # failed on their own account, after the root cause
    departed: tuple[int, ...] = ()  # returned while the collateral ranks waited; root first
    out_of_step: tuple[int, ...] = ()


def diagnose(outcomes: Sequence[RankOutcome], failed: Sequence[int]) -> Diagnosis:
    """Pick the root cause among the `failed` ranks: the first in time that a peer did not cause."""
    if not failed:
        return Diagnosis(None, (), ())
    by_rank = {o.rank: o for o in outcomes}
    primary = [r for r in failed if not by_rank[r].looks_collateral]
    if not primary:
        found = _out_of_step(by_rank, failed) or _departed(outcomes, by_rank, failed)
        if found is not None:
            return found
    pool = primary or list(failed)
    # A hang's time is the deadline it was found at, not when it began: a node lost before
    # then (its ranks silent, or the store gone) is the cause ranks waiting on it hung for.
    lost = any(by_rank[r].ending is Ending.LOST for r in pool)
    root = min(pool, key=lambda r: (lost and by_rank[r].ending is Ending.HUNG, by_rank[r].at, r))
    rest = [r for r in failed if r != root]
    collateral = tuple(r for r in rest if r not in primary)
    independent = tuple(r for r in rest if r in primary)
    return Diagnosis(root, collateral, independent)


def _out_of_step(by_rank: dict[int, RankOutcome], failed: Sequence[int]) -> Diagnosis | None:
    """Every failed rank hung, each in a collective, and not all in the same one."""
    hung = [by_rank[r] for r in failed]
    if not all(o.ending is Ending.HUNG and o.in_collective for o in hung):
        return None
    if len({o.in_collective for o in hung}) < 2:
        return None
    return Diagnosis(None, (), (), out_of_step=tuple(failed))


def _departed(
    outcomes: Sequence[RankOutcome], by_rank: dict[int, RankOutcome], failed: Sequence[int]
) -> Diagnosis | None:
    """Ranks that returned while every failure was peer-caused: the peers waited on them.

    The side with fewer ranks is the odd one out: ranks that returned while as many or more
    waited forgot the collective (the first of them is the root cause); a rank that waits
    while more ranks returned called one that no other did (it is the root cause). Not
    ordered by time: a rank that tore its group down reports its return after the peers'
    errors that the teardown caused.
    """
    left = sorted(
        (o for o in outcomes if o.ending is Ending.RETURNED and o.rank not in failed),
        key=lambda o: (o.at, o.rank),
    )
    if not left:
        return None
    departed = tuple(o.rank for o in left)
    if len(left) > len(failed):
        return Diagnosis(failed[0], tuple(failed[1:]), (), departed=departed)
    return Diagnosis(left[0].rank, tuple(failed), (), departed=departed)


def ranks_phrase(ranks: Sequence[int]) -> str:
    """'rank 2' or 'ranks 0, 2, 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def summary_line(outcomes: Sequence[RankOutcome], diagnosis: Diagnosis) -> str:
    """'rank 1 failed: raised AssertionError: ...; ranks 0, 2, 3 collateral'."""
    by_rank = {o.rank: o for o in outcomes}
    if diagnosis.out_of_step:
        return "ranks out of step: " + _where_each_is(by_rank, diagnosis.out_of_step)
    if diagnosis.departed:
        stayed = [r for r in (diagnosis.root, *diagnosis.collateral) if r not in diagnosis.departed]
        waited = sorted({by_rank[r].waited_in for r in stayed if r is not None} - {""})
        where = f" in {' / '.join(waited)}" if waited else ""
        if diagnosis.root not in diagnosis.departed:  # the waiting side is the odd one out
            return (
                f"{ranks_phrase([r for r in stayed if r is not None])} waited{where} while "
                f"{ranks_phrase(sorted(diagnosis.departed))} returned"
            )
        return (
            f"{ranks_phrase(diagnosis.departed)} returned while "
            f"{ranks_phrase(diagnosis.collateral)} waited{where}"
        )
    if diagnosis.root is None:
        return "every rank ended as expected"
    root = by_rank[diagnosis.root]
    also = list(diagnosis.independent)
    if root.ending is Ending.LOST:  # a node went away: named once, with all its ranks
        lost = [root.rank, *(r for r in also if by_rank[r].message == root.message)]
        also = [r for r in also if r not in lost]
        parts = [f"{root.describe()} ({ranks_phrase(sorted(lost))})"]
    else:
        parts = [f"rank {root.rank} failed: {root.describe()}"]
    if also:
        parts.append(f"{ranks_phrase(also)} also failed")
    if diagnosis.collateral:
        parts.append(f"{ranks_phrase(diagnosis.collateral)} collateral")
    return "; ".join(parts)


def _where_each_is(by_rank: dict[int, RankOutcome], ranks: Sequence[int]) -> str:
    """'rank 0 in broadcast; ranks 1, 2 in all_reduce', grouped in order of first rank."""
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(by_rank[r].in_collective, []).append(r)
    return "; ".join(f"{ranks_phrase(rs)} in {where}" for where, rs in groups.items())


def _role(rank: int, diagnosis: Diagnosis) -> str:
    if rank == diagnosis.root:
        return "root cause"
    if rank in diagnosis.out_of_step:
        return "out of step"
    if rank in diagnosis.departed:
        return "also returned early" if diagnosis.root in diagnosis.departed else "returned"
    return "collateral" if rank in diagnosis.collateral else "also failed"


def render_report(
    outcomes: Sequence[RankOutcome],
    diagnosis: Diagnosis,
    header: str,
    style: ReportStyle | None = None,
) -> str:
    """The failure text: the summary, then one section per failing rank, root cause first;
    collateral ranks one line each unless `style` says verbose."""
    style = style or ReportStyle()
    lines = [header, ""]
    order = [
        diagnosis.root,
        *diagnosis.departed,
        *diagnosis.out_of_step,
        *diagnosis.independent,
        *diagnosis.collateral,
    ]
    by_rank = {o.rank: o for o in outcomes}
    named = {diagnosis.root, *diagnosis.departed, *diagnosis.out_of_step, *diagnosis.independent}
    brief = [] if style.verbose else [r for r in diagnosis.collateral if r not in named]
    root = by_rank.get(diagnosis.root) if diagnosis.root is not None else None
    for r in dict.fromkeys(order):
        if r is None or r in brief:
            continue
        o = by_rank[r]
        if r != diagnosis.root and _lost_alike(o, root):
            continue  # the root's node, lost with it: named in the summary line
        if r in diagnosis.departed and diagnosis.root not in diagnosis.departed:
            continue  # returned while the root waited alone: named in the summary line
        lines.append(
            f"{'=' * 8} rank {r} ({_pid(o)}): {o.describe()} [{_role(r, diagnosis)}] {'=' * 8}"
        )
        for note in o.notes:
            lines.append(note)
        if o.traceback:
            lines.append(o.traceback.rstrip())
        if o.stack:
            lines.append("-- Python stacks at the deadline --")
            lines.append(o.stack.rstrip())
        if style.streams:
            for stream, text in (("stdout", o.stdout), ("stderr", o.stderr), ("log", o.log)):
                if text.strip():
                    lines.append(f"-- rank {r} captured {stream} --")
                    lines.append(without_cpp_frames(text).rstrip())
        lines.append("")
    if brief:
        lines += _collateral_lines([by_rank[r] for r in brief])
    return "\n".join(lines).rstrip() + "\n"


@dataclass(frozen=True)
class ReportStyle:
    """How much a failure report shows: every collateral rank's traceback (pytest's -v),
    and each rank's captured streams (not when pytest shows them in sections of its own)."""

    verbose: bool = True
    streams: bool = True


def _pid(o: RankOutcome) -> str:
    return f"pid {o.pid}" if o.pid else "pid unknown"  # a lost rank's, where none said it


def _lost_alike(o: RankOutcome, root: RankOutcome | None) -> bool:
    """Whether `o` was lost with the same node as the root cause."""
    lost = Ending.LOST
    return (
        root is not None and o.ending is lost and root.ending is lost and o.message == root.message
    )


def fold_runs(lines: list[str], pattern: re.Pattern[str], said: str) -> list[str]:
    """`lines` with each run of lines that `pattern` matches replaced by one line, `said`
    formatted with the run's length."""
    folded: list[str] = []
    run = 0
    for line in lines:
        if pattern.match(line):
            run += 1
            continue
        if run:
            folded.append(said.format(run))
            run = 0
        folded.append(line)
    if run:
        folded.append(said.format(run))
    return folded


def without_cpp_frames(text: str) -> str:
    """`text` with each C++ backtrace c10 appends to its errors and warnings ("Exception
    raised from ... (most recent call first):" and its "frame #N: ..." lines) cut to one
    line: they say nothing a test's author can act on, and run to 60 lines each."""
    kept = [line for line in text.splitlines(keepends=True) if not _CPP_RAISED.match(line)]
    lines = fold_runs(kept, _CPP_FRAME, "[{} C++ frames omitted]\n")
    return "".join(lines)


_CPP_FRAME = re.compile(r"^(frame #\d+: |<omitting python frames>)")
_CPP_RAISED = re.compile(r"^Exception raised from .* \(most recent call first\):")


def _collateral_lines(collateral: list[RankOutcome]) -> list[str]:
    """Collateral ranks, one line each: where each waited and what it got; a message that
    repeats (gloo's transport error on every peer) is shown once."""
    lines = [f"{'=' * 8} collateral: one line each (-v shows each one's report) {'=' * 8}"]
    seen: set[str] = set()
    for o in collateral:
        said = _collateral_phrase(o)
        where = f", waiting in {o.waited_in}" if o.waited_in else ""
        alike = _PEER_ADDRESS.sub("[peer]", said)
        lines.append(f"rank {o.rank} ({_pid(o)}){where}: {'the same' if alike in seen else said}")
        seen.add(alike)
    return lines


def _collateral_phrase(o: RankOutcome) -> str:
    """What happened to a collateral rank, in the harness's words: torch's transport error
    (gloo's runs to "Check the logs of the remote worker ... GLHF!") cut to the words that
    say what it was. rankwise's own errors name the failed rank already: kept as they are."""
    found = _PEER_ERROR_TEXT.search(o.message) if o.ending is Ending.RAISED else None
    if found is None or o.origin_rank is not None:
        return o.describe()
    return f"its collective failed as a peer went away ({o.exc_name}: {found.group(0)})"


_PEER_ADDRESS = re.compile(r"\[[0-9a-fA-F.:]+\]:\d+")  # gloo names each peer's address and port


class Expectation(Protocol):
    """One rank's expected end, as harness.common.expect.Expected provides it."""

    def matches(self, got: RankOutcome) -> bool: ...
    def describe(self) -> str: ...


def failed_ranks(
    outcomes: Sequence[RankOutcome], expected: Sequence[Expectation] = ()
) -> list[int]:
    """The ranks that did not end as `expected` (default: every rank returns)."""
    if expected:
        return [o.rank for o in outcomes if not expected[o.rank].matches(o)]
    return [o.rank for o in outcomes if not o.ok]


def root_cause(
    outcomes: Sequence[RankOutcome], expected: Sequence[Expectation] = ()
) -> RankOutcome | None:
    """The rank the failure report puts first; None when every rank ended as expected, or
    no one rank is to blame (ranks out of step)."""
    failed = failed_ranks(outcomes, expected)
    root = diagnose(outcomes, failed).root if failed else None
    return next((o for o in outcomes if o.rank == root), None)


def failure_text(
    outcomes: Sequence[RankOutcome],
    expected: Sequence[Expectation] = (),
    style: ReportStyle | None = None,
) -> str | None:
    """The report for outcomes that differ from `expected` (default: all return), or None."""
    failed = failed_ranks(outcomes, expected)
    if not failed:
        return None
    if expected:
        # The labels say who caused what among every rank that did not return, expected or
        # not: an unmet rank's failure may come from a peer whose own ending was expected.
        ended_badly = sorted(set(failed) | {o.rank for o in outcomes if not o.ok})
        diagnosis = diagnose(outcomes, ended_badly)
        header = f"expected outcomes not met on {ranks_phrase(failed)}"
        body = render_report(outcomes, diagnosis, expectation_table(expected, outcomes), style)
        return f"{header}\n\n{body}"
    diagnosis = diagnose(outcomes, failed)
    return render_report(outcomes, diagnosis, summary_line(outcomes, diagnosis), style)


def expectation_table(expected: Sequence[Expectation], outcomes: Sequence[RankOutcome]) -> str:
    """Expected against actual, one row per rank, '<-' on each rank that differs."""
    rows = [("rank", "expected", "got")]
    rows += [(str(o.rank), expected[o.rank].describe(), o.describe()[:100]) for o in outcomes]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for i, row in enumerate(rows):
        mark = "" if i == 0 or expected[outcomes[i - 1].rank].matches(outcomes[i - 1]) else "  <-"
        lines.append(
            " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + mark
        )
    return "\n".join(lines)


def set_up_failure_text(outcomes: Sequence[RankOutcome]) -> str:
    """The report when the harness could not set the ranks up: no rank of the test is to blame."""
    first = outcomes[0]
    return (
        f"harness error: the ranks could not be set up for this test "
        f"({first.setup_attempts} attempts); the test body never ran\n"
        f"{first.message}\n"
        f"This is not the test's failure: rerun it; if it persists, lower the machine's load "
        f"(fewer pytest -n workers) or raise --rank-timeout."
    )
