"""Expected outcomes: how each rank must end, checked against how it did.

Declare them with ``@pytest.mark.expect(...)`` on a rank test, or check a ``run_on_ranks``
result with ``WorldOutcome.expect(...)``. The forms:

- ``expect(returns())``: every rank returns (the default without a marker).
- ``expect(rank=1, does=raises(ValueError, match="bad"), others=returns())``: rank k does X,
  the others Y (``rank`` may be a list).
- ``expect({0: returns(), 1: exits(3), 2: killed(signal.SIGKILL), 3: aborts()})``: per rank;
  a rank left out must return.

Imports no torch.
"""

from __future__ import annotations

import re
import signal as signals
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.outcome import Ending, RankOutcome, signal_name

# rankwise.abort()'s exit status (rankwise._run.ABORT_EXIT_CODE; a test pins the two together).
RANKWISE_ABORT_EXIT_CODE = 70


class ExpectationError(ValueError):
    """An expected-outcome declaration that does not make sense; says where it came from."""


@dataclass(frozen=True)
class Expected:
    """One rank's expected end."""

    ending: str  # "returns", "raises", "exits", "killed", "aborts", "hangs"
    exc: str = ""  # exception class name for "raises"
    match: str | None = None
    code: int | None = None
    signal: int | None = None

    def matches(self, got: RankOutcome) -> bool:
        if self.ending == "returns":
            return got.ending is Ending.RETURNED
        if self.ending == "raises":
            return (
                got.ending is Ending.RAISED
                and self.exc in got.exc_mro
                and (self.match is None or re.search(self.match, got.message) is not None)
            )
        if self.ending == "exits":
            return got.ending in (Ending.EXITED, Ending.HARD_EXIT) and got.exit_code == self.code
        if self.ending == "killed":
            return got.ending is Ending.SIGNALLED and got.signal == self.signal
        if self.ending == "aborts":
            return got.ending is Ending.HARD_EXIT and got.exit_code == RANKWISE_ABORT_EXIT_CODE
        return got.ending is Ending.HUNG

    def describe(self) -> str:
        if self.ending == "raises":
            match = f" matching {self.match!r}" if self.match is not None else ""
            return f"raises {self.exc}{match}"
        if self.ending == "exits":
            return f"exits with code {self.code}"
        if self.ending == "killed":
            return f"dies of {signal_name(self.signal)}"
        if self.ending == "aborts":
            return f"aborts (rankwise.abort, exit status {RANKWISE_ABORT_EXIT_CODE})"
        return self.ending


def returns() -> Expected:
    """Returns normally (the expectation for every rank without a marker)."""
    return Expected("returns")


def raises(exc: type[BaseException] | str, match: str | None = None) -> Expected:
    """Raises `exc` (or a subclass; a class or its name), its message matching `match`."""
    name = exc if isinstance(exc, str) else exc.__name__
    if not isinstance(name, str) or not name:
        raise ExpectationError(f"raises() needs an exception class or name; got {exc!r}")
    return Expected("raises", exc=name, match=match)


def exits(code: int) -> Expected:
    """Ends with exit code `code`, by SystemExit or by the process exiting."""
    return Expected("exits", code=code)


def killed(signal: int = signals.SIGKILL) -> Expected:
    """Dies of `signal`."""
    return Expected("killed", signal=int(signal))


def aborts() -> Expected:
    """Leaves through rankwise's abort(): the traceback printed, then exit status 70."""
    return Expected("aborts")


def hangs() -> Expected:
    """Is still running at the deadline (and is killed)."""
    return Expected("hangs")


def from_marker(
    args: Sequence[Any], kwargs: Mapping[str, Any], world_size: int, origin: str
) -> list[Expected]:
    """One Expected per rank from the marker's forms (see the module docstring)."""

    def bad(what: str) -> ExpectationError:
        return ExpectationError(f"invalid expected outcome {what} from {origin}")

    per_rank: list[Expected] = [returns()] * world_size
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        for rank, expected in args[0].items():
            if not isinstance(rank, int) or not 0 <= rank < world_size:
                raise bad(f"rank {rank!r}: use ranks 0..{world_size - 1}")
            per_rank[rank] = _checked(expected, bad)
        return per_rank
    if len(args) == 1 and not kwargs:
        return [_checked(args[0], bad)] * world_size
    if args or "does" not in kwargs or set(kwargs) - {"rank", "does", "others"}:
        raise bad(
            "form: use expect(returns()), expect(rank=1, does=raises(E), others=returns()) "
            "or expect({0: ..., 1: ...})"
        )
    ranks = kwargs.get("rank", 0)
    ranks = list(ranks) if isinstance(ranks, (list, tuple)) else [ranks]
    others = _checked(kwargs.get("others", returns()), bad)
    does = _checked(kwargs["does"], bad)
    for rank in ranks:
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise bad(f"rank {rank!r}: use ranks 0..{world_size - 1}")
    return [does if r in ranks else others for r in range(world_size)]


def _checked(expected: Any, bad: Any) -> Expected:
    if not isinstance(expected, Expected):
        raise bad(f"{expected!r}: use returns(), raises(E), exits(C), killed(S), aborts(), hangs()")
    return expected


def mismatches(expected: Sequence[Expected], outcomes: Sequence[RankOutcome]) -> list[int]:
    return [o.rank for o in outcomes if not expected[o.rank].matches(o)]


def table(expected: Sequence[Expected], outcomes: Sequence[RankOutcome]) -> str:
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
