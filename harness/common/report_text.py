"""The words of a failed ranks test: the summary line (root cause first), one section per
failing rank, collateral ranks one line each, torch's C++ frames folded, the table of expected
against actual endings, and the harness's own set-up failure.

Imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from harness.common.diagnosis import PEER_ERROR_TEXT
from harness.common.outcome import Ending, RankOutcome
from harness.common.root_cause import Diagnosis, Expectation, diagnose, failed_ranks


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
    found = PEER_ERROR_TEXT.search(o.message) if o.ending is Ending.RAISED else None
    if found is None or o.origin_rank is not None:
        return o.describe()
    return f"its collective failed as a peer went away ({o.exc_name}: {found.group(0)})"


_PEER_ADDRESS = re.compile(r"\[[0-9a-fA-F.:]+\]:\d+")  # gloo names each peer's address and port


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
