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

import enum
import re
import signal as signals
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.common.errors import SpecError, invalid
from harness.common.outcome import Ending, RankOutcome, signal_name

# rankwise.abort()'s exit status (rankwise._run.ABORT_EXIT_CODE; a test pins the two together).
RANKWISE_ABORT_EXIT_CODE = 70


class ExpectationError(SpecError):
    """An expected-outcome declaration that does not make sense; says where it came from."""


class Wanted(enum.Enum):
    """The ways a rank may be expected to end."""

    RETURNS = "returns"
    RAISES = "raises"
    EXITS = "exits"
    KILLED = "killed"
    ABORTS = "aborts"
    HANGS = "hangs"


@dataclass(frozen=True)
class Expected:
    """One rank's expected end."""

    ending: Wanted
    exc: str = ""  # for RAISES: the class's qualified name ("pkg.errors.Timeout"), or a name
    match: str | None = None
    code: int | None = None
    signal: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ending, Wanted):
            choices = ", ".join(w.value for w in Wanted)
            raise ExpectationError(
                f"Expected.ending must be one of {choices} (a Wanted); got {self.ending!r}; "
                f"build it with returns(), raises(E), exits(C), killed(S), aborts() or hangs()"
            )

    def matches(self, got: RankOutcome) -> bool:
        return _MATCHERS[self.ending](self, got)

    def describe(self) -> str:
        if self.ending is Wanted.RAISES:
            match = f" matching {self.match!r}" if self.match is not None else ""
            return f"raises {self.exc.removeprefix('builtins.')}{match}"
        if self.ending is Wanted.EXITS:
            return f"exits with code {self.code}"
        if self.ending is Wanted.KILLED:
            return f"dies of {signal_name(self.signal)}"
        if self.ending is Wanted.ABORTS:
            return f"aborts (rankwise.abort, exit status {RANKWISE_ABORT_EXIT_CODE})"
        return str(self.ending.value)


def _raised_as_expected(want: Expected, got: RankOutcome) -> bool:
    return (
        got.ending is Ending.RAISED
        and any(is_class_named(want.exc, cls) for cls in got.exc_classes)
        and (want.match is None or re.search(want.match, got.message) is not None)
    )


def is_class_named(wanted: str, qualified: str) -> bool:
    """Whether the class of `qualified` name ("module.Qual.Name") is `wanted`: that same
    qualified name, or a name it ends with ("Name", "Qual.Name") when given as a string."""
    return qualified == wanted or qualified.endswith("." + wanted)


def class_name(cls: type) -> str:
    """What raises(cls) compares: the class's qualified name ("builtins.ValueError")."""
    return f"{cls.__module__}.{cls.__qualname__}"


_MATCHERS: dict[Wanted, Callable[[Expected, RankOutcome], bool]] = {
    Wanted.RETURNS: lambda want, got: got.ending is Ending.RETURNED,
    Wanted.RAISES: _raised_as_expected,
    Wanted.EXITS: lambda want, got: (
        got.ending in (Ending.EXITED, Ending.HARD_EXIT) and got.exit_code == want.code
    ),
    Wanted.KILLED: lambda want, got: got.ending is Ending.SIGNALLED and got.signal == want.signal,
    Wanted.ABORTS: lambda want, got: (
        got.ending is Ending.HARD_EXIT and got.exit_code == RANKWISE_ABORT_EXIT_CODE
    ),
    # Hung at the test's deadline: not killed early because a peer had failed.
    Wanted.HANGS: lambda want, got: got.ending is Ending.HUNG and not got.after_failure,
}


def returns() -> Expected:
    """Returns normally (the expectation for every rank without a marker)."""
    return Expected(Wanted.RETURNS)


def raises(exc: type[BaseException] | str, match: str | None = None) -> Expected:
    """Raises `exc` (or a subclass), its message matching `match`. A class is told apart from
    another of the same name; a name (a string) matches any class of that name."""
    name = exc if isinstance(exc, str) else class_name(exc) if isinstance(exc, type) else None
    if not isinstance(name, str) or not name:
        raise ExpectationError(f"raises() needs an exception class or name; got {exc!r}")
    return Expected(Wanted.RAISES, exc=name, match=match)


def exits(code: int) -> Expected:
    """Ends with exit code `code`, by SystemExit or by the process exiting."""
    return Expected(Wanted.EXITS, code=code)


def killed(signal: int = signals.SIGKILL) -> Expected:
    """Dies of `signal`."""
    return Expected(Wanted.KILLED, signal=int(signal))


def aborts() -> Expected:
    """Leaves through rankwise's abort(): the traceback printed, then exit status 70."""
    return Expected(Wanted.ABORTS)


def hangs() -> Expected:
    """Is still running at the deadline (and is killed)."""
    return Expected(Wanted.HANGS)


Bad = Callable[[str, object, str], ExpectationError]
_FORMS = "expect(returns()), expect(rank=1, does=raises(E), others=returns()) or expect({0: ...})"
_OUTCOMES = "use returns(), raises(E), exits(C), killed(S), aborts() or hangs()"


def from_marker(
    args: Sequence[Any], kwargs: Mapping[str, Any], world_size: int, origin: str
) -> list[Expected]:
    """One Expected per rank from the marker's forms (see the module docstring)."""

    def bad(what: str, value: object, fix: str) -> ExpectationError:
        return ExpectationError(invalid(what, value, origin, fix))

    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        per_rank: list[Expected] = [returns()] * world_size
        for rank, expected in args[0].items():
            per_rank[_checked_rank(rank, world_size, bad)] = _checked(expected, bad)
        return per_rank
    if len(args) == 1 and not kwargs:
        return [_checked(args[0], bad)] * world_size
    if args or "does" not in kwargs or set(kwargs) - {"rank", "does", "others"}:
        raise bad("expected outcome form", _form_text(args, kwargs), f"use {_FORMS}")
    ranks = kwargs.get("rank", 0)
    ranks = list(ranks) if isinstance(ranks, (list, tuple)) else [ranks]
    others = _checked(kwargs.get("others", returns()), bad)
    does = _checked(kwargs["does"], bad)
    chosen = {_checked_rank(rank, world_size, bad) for rank in ranks}
    return [does if r in chosen else others for r in range(world_size)]


def _form_text(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"expect({', '.join(parts)})"


def _checked_rank(rank: Any, world_size: int, bad: Bad) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise bad("expected outcome rank", rank, f"use ranks 0..{world_size - 1}")
    return rank


def _checked(expected: Any, bad: Bad) -> Expected:
    if not isinstance(expected, Expected):
        raise bad("expected outcome", expected, _OUTCOMES)
    return expected
