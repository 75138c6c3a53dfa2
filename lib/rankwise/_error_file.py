"""torchrun's error file: the launcher names the rank rankwise names.

torchrun's summary calls "Root Cause" the failed worker with the smallest timestamp in its
error file (TORCHELASTIC_ERROR_FILE; whole seconds; ties go to the lowest local rank), and the
time it noticed the exit for a worker without one. Left alone it names whichever rank it saw
exit first, often a rank that only raised because a peer did. So on a launch:

- the rank whose own `fn` failed writes its file before its peers can learn of the failure
  (before the exchange that tells them), stamped `EARLIER_S` before the failure: it exists
  whichever process the launcher sees exit first, and it sorts first;
- a rank that raises because a peer failed (collateral) writes, as it leaves, an entry that
  says so and names the peer, stamped `LATER_S` after it left, and prints one line instead
  of a traceback (unless RANKWISE_COLLATERAL_TRACEBACKS=1).

Nothing here runs without TORCHELASTIC_ERROR_FILE; nothing here reads a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
FULL_TRACEBACKS_ENV = "RANKWISE_COLLATERAL_TRACEBACKS"
EARLIER_S = 1
LATER_S = 1

_FAILED_AT = "_rankwise_failed_at"  # on this rank's own error: when its fn failed


def path() -> str | None:
    """Where the launcher reads this worker's error, or None when not under torchrun."""
    return os.environ.get(ERROR_FILE_ENV) or None


def full_tracebacks() -> bool:
    """Whether collateral ranks print their whole traceback (asked for by the environment)."""
    return os.environ.get(FULL_TRACEBACKS_ENV, "").strip().lower() in ("1", "true", "yes")


def is_collateral(error: BaseException, this_rank: int) -> bool:
    """Raised here because another rank failed: its origin_rank names another rank."""
    origin = getattr(error, "origin_rank", None)
    return isinstance(origin, int) and origin != this_rank


def note_own_failure(error: BaseException) -> None:
    """This rank's fn raised `error`: write the error file now, before any peer hears of it."""
    if getattr(error, _FAILED_AT, None) is None:  # an inner collective's: kept
        with contextlib.suppress(AttributeError, TypeError):
            setattr(error, _FAILED_AT, time.time())
    if path() is not None:
        _write_own(error)
        _hook_uncaught()


_PEERS_LOST = "_rankwise_peers_lost"
# Called once a rank has said which peers were lost, as it ends (set by the peer watch): it
# waits a little for the other survivors to say so too, since torchrun ends a node's other
# workers as soon as one of them exits.
spoken: Callable[[BaseException], None] | None = None


def note_peers_lost(error: BaseException, in_flight: bool) -> None:
    """`error` names peers that died or went silent: write it as this rank's entry now (it
    is what happened, whichever rank the launcher lists). With a collective still `in_flight`
    on silent peers, an error that ends the process ends it without waiting: gloo's teardown
    would wait for them for its whole timeout."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, _PEERS_LOST, in_flight)
    if path() is not None:
        callstack = f"{_describe(error)}\n(no traceback: a peer was lost, not this rank's code)"
        write_entry(_describe(error), callstack, int(time.time()) - EARLIER_S)
    _hook_uncaught(always=in_flight)


def note_collateral(error: BaseException) -> None:
    """`error` names a peer's failure: if it leaves the process, say so in one line."""
    if path() is not None:
        _hook_uncaught()


def leaving(error: BaseException, this_rank: int) -> None:
    """`error` is leaving a run on a launch: write its entry, and again if it ends the process
    (an error a body caught and replaced writes its own then)."""
    if path() is not None and not isinstance(error, (SystemExit, KeyboardInterrupt)):
        write_for(error, this_rank)
        _hook_uncaught()


def write_for(error: BaseException, this_rank: int) -> None:
    """The entry for a rank leaving the run with `error`: its own, or collateral."""
    if path() is None or hasattr(error, _PEERS_LOST):  # that one was written already
        return
    if is_collateral(error, this_rank):
        write_entry(
            message=f"collateral: {_describe(error)}",
            callstack=f"collateral: {error}",
            timestamp=int(time.time()) + LATER_S,
        )
    else:
        _write_own(error)


def one_line(error: BaseException, prefix: str) -> str:
    """What a collateral rank prints instead of its traceback: `prefix`, then what it was."""
    return f"{prefix}: collateral: {error} (set {FULL_TRACEBACKS_ENV}=1 for this rank's traceback)"


def _write_own(error: BaseException) -> None:
    failed_at = getattr(error, _FAILED_AT, None)
    when = failed_at if isinstance(failed_at, float) else time.time()
    callstack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    write_entry(message=_describe(error), callstack=callstack, timestamp=int(when) - EARLIER_S)


def _describe(error: BaseException) -> str:
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:  # its __str__ raised: the type still says what it was
        return type(error).__name__


def write_entry(message: str, callstack: str, timestamp: int) -> bool:
    """Write this worker's entry in torchrun's format (what its ErrorHandler writes): whether
    there was a file to write (a failure to write is not the run's, and is not raised)."""
    target = path()
    if target is None:
        return False
    extra = {"py_callstack": callstack, "timestamp": str(timestamp)}
    data = {"message": {"message": message, "extraInfo": extra}}
    with contextlib.suppress(OSError), open(target, "w", encoding="utf-8") as out:
        json.dump(data, out)
    return True


def _hook_uncaught(always: bool = False) -> None:
    """Install, once, the hook that writes the entry of an error that ends the process (on
    a launch, or `always`), and ends a process whose peers were lost without waiting."""
    if getattr(sys.excepthook, "_rankwise", False):
        return
    if path() is None and not always:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        this_rank = _rank_of_launch()
        if not hasattr(error, _PEERS_LOST):
            write_for(error, this_rank)  # a lost peer's entry was written when it was found
        if is_collateral(error, this_rank) and not full_tracebacks():
            print(one_line(error, f"rankwise: rank {this_rank} exits"), file=sys.stderr, flush=True)
        else:
            previous(kind, error, tb)
        if hasattr(error, _PEERS_LOST):
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            if spoken is not None:
                spoken(error)  # the other survivors get to say it too before this rank ends
        if getattr(error, _PEERS_LOST, False):
            os._exit(1)  # gloo's teardown would wait for the lost peers for its timeout

    hook._rankwise = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _rank_of_launch() -> int:
    """This worker's rank from the launch (the group may be gone by the time it exits)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
