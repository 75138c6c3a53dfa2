"""Turning what a body did in a rank into its outcome record: an exception (pytest's skip,
xfail and exit among them), a SystemExit, a return value, a fault that never fired; the
traceback text starting at the test's own frames; the failed frames freed so that tearing
the group down really closes it. Used by rank/body.py, for every kind of rank.

Imports no torch.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import sys
import time
import traceback
from typing import Any, TypeAlias

from harness.common.outcome import Ending, RankOutcome, exit_code

# pytest's outcome exceptions a test body may raise (pytest.skip, pytest.xfail): their class
# names, a quick first test before the classes themselves are checked.
PYTEST_OUTCOMES = {"Skipped": Ending.SKIPPED, "XFailed": Ending.XFAILED}
_OWN_FILES: set[str] = {__file__}
# pytest's --showlocals for a rank's tracebacks: the longest repr of a local kept (0: whole),
# or None to show no locals.
LocalsShown: TypeAlias = int | None
SHORT_LOCALS = 240  # pytest's own cut, below -vv


def skip_frames_of(file: str) -> None:
    """Start tracebacks after `file`'s frames too (the harness code that calls the body)."""
    _OWN_FILES.add(file)


def ended_by(
    key: str, rank: int, exc: BaseException, show_locals: LocalsShown = None
) -> RankOutcome:
    """The outcome of a body that raised `exc` (an error, sys.exit, pytest.skip or xfail),
    built once from everything `exc` says."""
    origin = getattr(exc, "origin_rank", None)  # rankwise's collectives say whose failure
    origin = origin if isinstance(origin, int) and not isinstance(origin, bool) else None
    if isinstance(exc, SystemExit):
        said = ""
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)  # as Python does for sys.exit("message")
            said = text_of(exc.code)
        return RankOutcome(
            key,
            rank,
            os.getpid(),
            Ending.EXITED,
            at=time.monotonic(),
            exit_code=exit_code(exc),
            message=said,
            traceback=user_traceback(exc, show_locals),  # where it was called
            origin_rank=origin,
        )
    if (ending := _pytest_outcome(exc)) is not None:
        message = text_of(getattr(exc, "msg", exc))
        at = _raised_at(exc) if ending is Ending.SKIPPED else None
        now = time.monotonic()
        return RankOutcome(key, rank, os.getpid(), ending, at=now, message=message, skipped_at=at)
    returncode = getattr(exc, "returncode", None)  # pytest.exit's, to stop the session with
    stops = type(exc).__name__ == "Exit" and isinstance(returncode, int)
    return raised(
        key,
        rank,
        exc,
        show_locals=show_locals,
        exit_code=returncode if stops else None,
        origin_rank=origin,
    )


def _pytest_outcome(exc: BaseException) -> Ending | None:
    """SKIPPED or XFAILED for pytest's own skip and xfail, not for a class named alike;
    SKIPPED for ``unittest.SkipTest`` too, as pytest takes it in any test."""
    unittest = sys.modules.get("unittest")
    if unittest is not None and isinstance(exc, unittest.SkipTest):
        return Ending.SKIPPED
    if type(exc).__name__ not in PYTEST_OUTCOMES:
        return None
    from harness.common.pytest_internals import Skipped, XFailed

    if isinstance(exc, XFailed):
        return Ending.XFAILED
    return Ending.SKIPPED if isinstance(exc, Skipped) else None


def _raised_at(exc: BaseException) -> tuple[str, int] | None:
    """Where `exc` was raised from, as pytest tells a skip's place: the last frame of its
    traceback that does not hide itself (pytest.skip does)."""
    at = None
    tb = exc.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_locals.get("__tracebackhide__", False):
            at = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return at


def qualified_name(cls: type) -> str:
    """'builtins.ValueError', 'pkg.errors.TimeoutError': what tells two classes apart."""
    return f"{cls.__module__}.{cls.__qualname__}"


def text_of(value: object) -> str:
    """str(value), or what it is when its __str__ fails (the report must still be made)."""
    try:
        return str(value)
    except Exception as exc:
        return f"<str() of {type(value).__name__} raised {type(exc).__name__}>"


def raised(
    key: str,
    rank: int,
    exc: BaseException,
    note: str = "",
    show_locals: LocalsShown = None,
    exit_code: int | None = None,
    origin_rank: int | None = None,
    own_class_only: bool = False,
) -> RankOutcome:
    """A rank whose body (or the harness's set-up, with a `note` saying so) raised `exc`;
    `own_class_only`: its class without its bases (no expected exception may match them)."""
    mro = type(exc).__mro__[:1] if own_class_only else type(exc).__mro__
    return RankOutcome(
        key,
        rank,
        os.getpid(),
        Ending.RAISED,
        at=time.monotonic(),
        exc_type=qualified_name(type(exc)),
        exc_mro=tuple(cls.__name__ for cls in mro),
        exc_classes=tuple(qualified_name(cls) for cls in mro),
        message=text_of(exc),
        traceback=user_traceback(exc, show_locals),
        exit_code=exit_code,
        origin_rank=origin_rank,
        notes=(note,) if note else (),
    )


def not_reached(key: str, rank: int, missed: BaseException) -> RankOutcome:
    """A rank that returned with a fault never fired: the test's own mistake, which no
    expected exception (not even raises(BaseException)) or xfail(raises=E) may take for
    the fault. Never raised: no traceback, the message says it all."""
    return raised(key, rank, missed, own_class_only=True)


def returned(key: str, rank: int, value: Any, keep_value: bool = True) -> RankOutcome:
    """A rank that returned `value`: its repr, and (`keep_value`) the value itself pickled,
    for the pytest side to load."""
    at = time.monotonic()  # its time: before the value is pickled
    if value is None:
        return RankOutcome(key, rank, os.getpid(), Ending.RETURNED, at=at)
    shown = safe_repr(value)
    blob, lost = None, ""
    if keep_value:
        try:
            blob = pickle.dumps(value)
        except Exception as exc:
            lost = f"{type(exc).__name__}: {text_of(exc)}"
    notes = (f"the return value could not be sent back: {lost}",) if lost else ()
    return RankOutcome(
        key,
        rank,
        os.getpid(),
        Ending.RETURNED,
        at=at,
        value_repr=shown,
        value_blob=blob,
        value_lost=lost,
        notes=notes,
    )


def user_traceback(exc: BaseException, show_locals: LocalsShown = None) -> str:
    """The traceback text from the first frame that is not the harness's own; with
    `show_locals` (pytest's --showlocals: the longest repr kept, None for no locals), each
    frame's local variables under it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
        tb = tb.tb_next  # the report starts in the user's code, not in ours
    shown = traceback.TracebackException(type(exc), exc, tb, compact=True)
    if show_locals is not None:
        frames = [frame for frame, _ in traceback.walk_tb(tb)]
        for summary, frame in zip(shown.stack, frames, strict=False):
            summary.locals = _locals_text(frame.f_locals, show_locals)
    return "".join(shown.format())


def _locals_text(variables: dict[str, Any], size: int) -> dict[str, str]:
    """A frame's locals as pytest shows them: sorted, cut to `size` (0: whole), less the
    helpers assertion rewriting adds (their names start with '@')."""
    from harness.common.pytest_internals import saferepr

    return {
        name: saferepr(variables[name], size or None)
        for name in sorted(variables)
        if not name.startswith("@")
    }


def refuse_awaitable(value: Any) -> None:
    """Fail a coroutine test as pytest does without an async plugin, instead of passing it."""
    if not (hasattr(value, "__await__") or hasattr(value, "__aiter__")):
        return
    with contextlib.suppress(Exception):
        value.close()  # never awaited: no RuntimeWarning about it either
    from harness.common.pytest_internals import fail_as_async

    fail_as_async()  # raises pytest's Failed with pytest's own message


def safe_repr(value: Any) -> str:
    """repr(value), its first 500 characters, or its type's name when repr fails."""
    try:
        return repr(value)[:500]
    except Exception:
        return f"<{type(value).__name__}>"


def free_frames(exc: BaseException) -> None:
    """Drop what the failed test still holds, so tearing its group down really closes it.

    The traceback's frames keep the test's locals alive (a model, its FSDP mesh, and through
    them the process group); while anything holds the group its connections stay open and
    peers blocked on this rank would wait instead of failing.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current.__traceback__ = None
        current = current.__cause__ or current.__context__
    gc.collect()
