"""Per-rank faults: what to do (raise, exit, die, hang, straggle), on which rank, and where.

A :class:`Fault` is declared with ``@pytest.mark.fault(...)`` (repeatable), through the
``rank_faults`` fixture, or passed to ``run_on_ranks(..., faults=[...])``. Inside a rank an
:class:`Injector` fires it at the start of the body, or when the code under test passes a
named point: one of rankwise's labelled collectives (``"all_reduce:step"``, or just the label
``"step"``), ``distributed_run``'s entry or exit (``"distributed_run:enter"`` / ``":exit"``),
or any point the code marks with :func:`fault_point`. ``nth`` picks the Nth pass.

Imports no torch: the pytest side validates faults at collection time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal as signals
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.common.errors import SpecError, invalid

KINDS = ("raise", "exit", "hard_exit", "signal", "hang", "delay")
SIGNALS = {
    "SIGKILL": signals.SIGKILL,
    "SIGSEGV": signals.SIGSEGV,
    "SIGTERM": signals.SIGTERM,
    "SIGABRT": signals.SIGABRT,
}
START = "start"


class FaultError(SpecError):
    """A fault declaration that cannot be carried out; says where it came from."""


class FaultHangEnded(BaseException):
    """Ends a thread-rank's injected hang once its world has given up on it."""


class FaultNotReached(Exception):
    """A rank returned without passing the point one of its faults waits for."""


@dataclass(frozen=True)
class Fault:
    """One fault on some ranks: `kind` at point `at` (default: the start of the body)."""

    rank: int | tuple[int, ...] | str = 1  # a rank, several, or "all"
    kind: str = "raise"
    at: str = START
    nth: int = 1
    exc: Any = None  # for "raise": an exception instance or class (default RuntimeError)
    code: int = 1  # for "exit" and "hard_exit"
    signal: int | str = "SIGKILL"  # for "signal"
    seconds: float = 1.0  # for "delay"

    def ranks(self, world_size: int) -> tuple[int, ...]:
        if self.rank == "all":
            return tuple(range(world_size))
        return (self.rank,) if isinstance(self.rank, int) else tuple(self.rank)  # type: ignore[arg-type]

    def describe(self) -> str:
        where = "at the start of the body" if self.at == START else f"at {self.at!r}"
        nth = f" (pass {self.nth})" if self.nth != 1 else ""
        return f"{self.kind} {where}{nth}"


def validate(fault: Fault, world_size: int, origin: str) -> Fault:
    """Check every field, raising FaultError that names `origin` and what is allowed."""

    def bad(what: str, value: object, fix: str) -> FaultError:
        return FaultError(invalid(f"fault {what}", value, origin, fix))

    if fault.kind not in KINDS:
        raise bad("kind", fault.kind, f"choose one of {', '.join(KINDS)}")
    ranks = fault.rank if isinstance(fault.rank, (tuple, list)) else (fault.rank,)
    if fault.rank != "all":
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise bad("rank", r, f"use a rank in 0..{world_size - 1}, a list of them, or 'all'")
    if not isinstance(fault.at, str) or not fault.at:
        raise bad("point", fault.at, "use 'start' or a point name such as 'all_reduce:step'")
    if isinstance(fault.nth, bool) or not isinstance(fault.nth, int) or fault.nth < 1:
        raise bad("nth", fault.nth, "use an int >= 1")
    if fault.kind == "signal":
        _signal_number(fault.signal, bad)
    if fault.kind in ("exit", "hard_exit") and (
        isinstance(fault.code, bool) or not isinstance(fault.code, int)
    ):
        raise bad("exit code", fault.code, "use an int")
    if fault.kind == "delay" and not (
        isinstance(fault.seconds, (int, float)) and fault.seconds >= 0
    ):
        raise bad("delay", fault.seconds, "use seconds >= 0")
    if fault.kind == "raise" and fault.exc is not None:
        if not _is_exception(fault.exc):
            raise bad("exception", fault.exc, "use an exception instance or class")
        _check_travels(fault.exc, bad)
    if isinstance(fault.rank, list):
        fault = dataclasses.replace(fault, rank=tuple(fault.rank))
    return fault


def _check_travels(exc: Any, bad: Bad) -> None:
    """A fault's exception goes to the ranks pickled: one that cannot come back as itself
    would fail every rank there, blaming none of them rightly."""
    try:
        _rebuilt(exc)
    except Exception as error:
        if isinstance(exc, type):
            fix = "define it at module level, where a rank can import it by name"
        else:
            fix = (
                f"it must survive pickling to reach a rank ({type(error).__name__}: {error}); "
                f"give its class an __init__ that accepts the args it passes to Exception, "
                f"or pass the class"
            )
        raise bad("exception", exc, fix) from None


def _is_exception(exc: Any) -> bool:
    return isinstance(exc, BaseException) or (
        isinstance(exc, type) and issubclass(exc, BaseException)
    )


Bad = Callable[[str, object, str], FaultError]


def _signal_number(value: int | str, bad: Bad) -> int:
    if isinstance(value, str):
        if value.upper() not in SIGNALS:
            raise bad("signal", value, f"choose one of {', '.join(SIGNALS)}")
        return int(SIGNALS[value.upper()])
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad("signal", value, "use a signal number or name")
    return int(value)


def from_marker(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Fault]:
    """``fault(Fault(...), ...)`` or ``fault(rank=1, kind="exit", code=3, ...)``."""
    if args and all(isinstance(a, Fault) for a in args) and not kwargs:
        return list(args)
    if args:
        raise FaultError(
            "the fault marker takes Fault(...) objects or keyword fields such as "
            "fault(rank=1, kind='exit', code=3)"
        )
    unknown = set(kwargs) - set(Fault.__dataclass_fields__)
    if unknown:
        fields = ", ".join(sorted(Fault.__dataclass_fields__))
        raise FaultError(f"unknown fault field(s) {', '.join(sorted(unknown))}: use {fields}")
    return [Fault(**kwargs)]


# ---- inside a rank --------------------------------------------------------------------------


@dataclass
class Injector:
    """Fires this rank's faults at their points; counts every point passed during the run."""

    rank: int
    faults: tuple[Fault, ...]
    passes: dict[str, int] = field(default_factory=dict)  # by every name a fault may use
    seen: dict[str, int] = field(default_factory=dict)  # by the name a report shows
    fired: set[int] = field(default_factory=set)  # indexes into faults
    # What ends a "hang" (a thread-rank's, which cannot be killed); None: nothing does.
    release: threading.Event | None = None
    hung: bool = False  # a "hang" fault fired here

    def at_start(self) -> None:
        self._passed(START, START, START)

    def observe(self, phase: str, kind: str, label: str) -> None:
        """A rankwise point observer: faults fire on entry."""
        if phase == "enter":
            full = f"{kind}:{label}"
            self._passed(full, label, full)

    def _passed(self, full: str, label: str, shown: str) -> None:
        for name in {full, label}:
            self.passes[name] = self.passes.get(name, 0) + 1
        self.seen[shown] = self.seen.get(shown, 0) + 1
        for index, fault in enumerate(self.faults):
            if fault.at in (full, label) and self.passes[fault.at] == fault.nth:
                self.fired.add(index)
                self.hung = self.hung or fault.kind == "hang"
                _fire(fault, self.rank, full, self.release)

    def unreached(self) -> FaultNotReached | None:
        """The error for this rank's faults that never fired (a misspelt point, too few passes)."""
        missed = [f for i, f in enumerate(self.faults) if i not in self.fired]
        if not missed:
            return None
        points = ", ".join(f"{name!r} ({n})" for name, n in sorted(self.seen.items()))
        sentences = [f"fault {f.describe()} was never reached on rank {self.rank}" for f in missed]
        return FaultNotReached(
            f"{'; '.join(sentences)}; points passed on rank {self.rank}: {points}; "
            f"check the fault's at= against these names"
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[Injector]:
        global _active
        if not self.faults:
            yield self
            return
        points = rankwise_points()
        if points is not None:
            points.add_observer(self.observe)
        _active = self
        try:
            yield self
        finally:
            _active = None
            if points is not None:
                points.remove_observer(self.observe)


_active: Injector | None = None
# A thread-rank's injector (threaded_world): points passed on that thread fire its faults.
_on_this_thread = threading.local()


@contextlib.contextmanager
def on_this_thread(injector: Injector) -> Iterator[Injector]:
    """Fire `injector`'s faults at the points this thread passes (a thread-rank's)."""
    _on_this_thread.injector = injector
    try:
        yield injector
    finally:
        _on_this_thread.injector = None


def thread_observer(phase: str, kind: str, label: str) -> None:
    """A rankwise point observer for thread-ranks: the passing thread's injector's."""
    injector = getattr(_on_this_thread, "injector", None)
    if injector is not None:
        injector.observe(phase, kind, label)


# Told, before a fault ends this process, what the fault was: a rank torchrun launched has
# no pool to see how it died, so it leaves word in the launch's store.
FatalHook = Callable[[str, int | None, int | None], None]  # text, signal, code
before_fatal: FatalHook | None = None  # set through call_before_fatal


def call_before_fatal(hook: FatalHook | None) -> None:
    """Call `hook` before a fault ends this process (a launched session tells its peers what
    it was); None: call nothing."""
    global before_fatal
    before_fatal = hook


def fault_point(name: str) -> None:
    """Mark a point in the code under test where a test can inject a fault (``at=name``).

    Costs one check when no fault is armed; does nothing outside a harness rank.
    """
    active = getattr(_on_this_thread, "injector", None) or _active
    if active is not None:
        active._passed(f"point:{name}", name, name)


def rankwise_points() -> Any:
    """rankwise's tools module (add_observer, remove_observer for its named points), or
    None where rankwise is not installed."""
    try:
        from rankwise import testing
    except ImportError:
        return None
    return testing


def _unreachable(what: str, value: object, fix: str) -> FaultError:
    raise AssertionError(f"fault {what} {value!r} passed validation")  # validated before


def _afresh(exc: BaseException) -> BaseException:
    """A copy of a fault's exception instance: one shared by several runs (parametrized
    tests in a launched session) would carry every earlier run's traceback and notes."""
    try:
        return _rebuilt(exc)  # type: ignore[no-any-return]
    except Exception:  # validated to travel; should it not, the instance, its old trace cut
        return exc.with_traceback(None)


def _rebuilt(exc: Any) -> Any:
    """`exc` as a rank gets it: pickled and loaded."""
    return pickle.loads(pickle.dumps(exc))


def _fire(fault: Fault, rank: int, where: str, release: threading.Event | None = None) -> None:
    message = f"fault injected by the harness on rank {rank} at {where}"
    if fault.kind == "raise":
        exc = fault.exc if fault.exc is not None else RuntimeError
        raise exc(message) if isinstance(exc, type) else _afresh(exc)
    if fault.kind == "exit":
        sys.exit(fault.code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if fault.kind in ("hard_exit", "signal") and before_fatal is not None:
        with contextlib.suppress(Exception):
            hard = fault.kind == "hard_exit"
            what = f"os._exit({fault.code})" if hard else str(fault.signal)
            signum = None if hard else _signal_number(fault.signal, _unreachable)
            before_fatal(
                f"{what} at {where}, a fault injected by the harness",
                signum,
                fault.code if hard else None,
            )
    if fault.kind == "hard_exit":
        os._exit(fault.code)
    if fault.kind == "signal":
        os.kill(os.getpid(), _signal_number(fault.signal, _unreachable))
        threading.Event().wait(5)  # a handled or slow signal: give it time to land
        return
    if fault.kind == "hang":
        (release or threading.Event()).wait()  # until the harness's deadline kills the rank
        raise FaultHangEnded(f"{message}: hung until the world ended")
    time.sleep(float(fault.seconds))  # delay: a straggler, then carry on
