"""pytest's warning filters inside ranks, and rank warnings in pytest's summary.

A rank applies the filters the pytest process would apply to the test (the ini's
``filterwarnings``, ``-W``, then the test's ``filterwarnings`` markers, in pytest's order),
so a warning filtered to an error fails the rank that raised it. Warnings a rank only
records travel back and are re-emitted in the pytest process, "[rank k] message", so they
show in the warnings summary. Imports no torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from harness.common import endings, pytest_internals
from harness.common.outcome import RankOutcome, RankWarning
from harness.common.protocol import WarningFilters
from harness.common.report_text import ranks_phrase


def filters_for(config: pytest.Config, node: pytest.Item | None) -> WarningFilters:
    """The filters pytest applies to `node` (the session's alone without one)."""
    marks = () if node is None else node.iter_markers(name="filterwarnings")
    return WarningFilters(
        config=tuple(config.getini("filterwarnings")),
        cmdline=tuple(config.known_args_namespace.pythonwarnings or ()),
        marks=tuple(str(arg) for mark in marks for arg in mark.args),
        python_warnoptions=bool(sys.warnoptions),
    )


@contextlib.contextmanager
def recording(filters: WarningFilters) -> Iterator[list[warnings.WarningMessage]]:
    """In a rank: apply `filters` as pytest would around a test, and record what passes them."""
    with warnings.catch_warnings(record=True) as log:
        if not filters.python_warnoptions:  # pytest shows deprecations unless told otherwise
            warnings.filterwarnings("always", category=DeprecationWarning)
            warnings.filterwarnings("always", category=PendingDeprecationWarning)
        _apply_session_filters(filters.config, filters.cmdline)
        for arg in filters.marks:
            warnings.filterwarnings(*_parsed(arg, escape=False))
        yield log


def _apply_session_filters(config: tuple[str, ...], cmdline: tuple[str, ...]) -> None:
    """pytest's apply_warning_filters, with each filter parsed once per rank (the same ones
    come with every test)."""
    try:
        parsed = [_parsed(arg, escape=False) for arg in config]
        parsed += [_parsed(arg, escape=True) for arg in cmdline]
    except Exception:  # pytest's own handling of a filter it cannot parse, which varies
        pytest_internals.apply_warning_filters(config, cmdline)
        return
    for args in parsed:
        warnings.filterwarnings(*args)


@functools.lru_cache(maxsize=256)
def _parsed(arg: str, escape: bool) -> tuple[Any, ...]:
    """A filter as pytest parses it (a split, an import, a regex escape); errors are not
    cached. pytest caches its own parsing the same way, warning classes included."""
    return pytest_internals.parse_warning_filter(arg, escape)


def collected(log: Sequence[warnings.WarningMessage]) -> tuple[RankWarning, ...]:
    """What a rank recorded, in a form that travels."""
    return tuple(
        RankWarning(
            category=f"{w.category.__module__}.{w.category.__qualname__}",
            message=str(w.message),
            filename=w.filename,
            lineno=w.lineno,
        )
        for w in log
    )


def reemit(outcomes: Sequence[RankOutcome]) -> None:
    """In the pytest process: warn once per distinct warning, naming the ranks that gave it.

    Re-emitted with "always", since the ranks already applied the filters (the prefixed
    message would not match a filter's message pattern again).
    """
    by_warning: dict[RankWarning, list[int]] = {}
    for outcome in outcomes:
        for found in outcome.warnings:
            by_warning.setdefault(found, []).append(outcome.rank)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for found, ranks in by_warning.items():
            warnings.warn_explicit(
                f"[{ranks_phrase(ranks)}] {found.message}",
                _category(found.category),
                found.filename,
                found.lineno,
            )


def _category(name: str) -> type[Warning]:
    module, _, qualname = name.rpartition(".")
    with contextlib.suppress(Exception):
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        if isinstance(found, type) and issubclass(found, Warning):
            return found
    return UserWarning


class StrayExceptions:
    """Exceptions raised where no caller sees them, during a test in a rank: in a thread of
    it, or unraisable (in __del__, a weakref callback). pytest turns these into warnings in
    a plain test; warn() does the same in the rank, so filters (-W error) apply there."""

    def __init__(self) -> None:
        self.texts: list[tuple[type[Warning], str]] = []

    def thread(self, args: Any) -> None:
        name = args.thread.name if args.thread is not None else "<unknown>"
        self._add("PytestUnhandledThreadExceptionWarning", f"Exception in thread {name}", args)

    def unraisable(self, args: Any) -> None:
        said = f"{args.err_msg or 'Exception ignored in'}: {endings.safe_repr(args.object)}"
        self._add("PytestUnraisableExceptionWarning", said, args)

    def _add(self, category: str, said: str, args: Any) -> None:
        import traceback

        lines = traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
        self.texts.append((getattr(pytest, category), f"{said}\n\n{''.join(lines)}"))

    def warn(self) -> None:
        """Warn for each, in order (an error filter raises the first)."""
        found, self.texts = self.texts, []
        for category, text in found:
            warnings.warn(category(text), stacklevel=1)


@contextlib.contextmanager
def stray_exceptions(kinds: frozenset[str]) -> Iterator[StrayExceptions]:
    """In a rank, around a test: collect its stray exceptions of `kinds` ("thread",
    "unraisable") instead of printing them."""
    stray = StrayExceptions()
    old_thread, old_unraisable = threading.excepthook, sys.unraisablehook
    if "thread" in kinds:
        threading.excepthook = stray.thread
    if "unraisable" in kinds:
        sys.unraisablehook = stray.unraisable
    try:
        yield stray
    finally:
        threading.excepthook, sys.unraisablehook = old_thread, old_unraisable
