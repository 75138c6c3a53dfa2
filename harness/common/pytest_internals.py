"""The one place the harness reaches into pytest's private modules (``_pytest``), each use
named for what it is for, so that a pytest release that moves one breaks one function here.

pytest's public API covers most of what the harness needs (``pytest.skip.Exception``,
``pytest.fail.Exception``, ``pytest.exit.Exception``, ``pytest.CaptureFixture``); what it
does not (assertion rewriting and comparisons in a rank, warning filters applied by hand,
capture and caplog made in a rank, the terminal writer, junit's stash key) comes from here,
imported when first asked for.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any

import _pytest.outcomes
import pytest

# pytest.xfail as pytest defines it: under --runxfail the harness swaps pytest.xfail for a
# no-op in a rank, and puts this back for a session without it.
real_xfail = _pytest.outcomes.xfail
# pytest.fail's exception (pytest.fail.Exception), as a class to derive from: a test failed
# with this message alone.
Failed = _pytest.outcomes.Failed
# pytest.skip's and pytest.xfail's exceptions, bound before any test could patch pytest's
# names (a rank test's monkeypatch is undone only after its outcome is made).
Skipped = _pytest.outcomes.Skipped
XFailed = _pytest.outcomes.XFailed


def saferepr(value: object, maxsize: int | None) -> str:
    """repr(value) as pytest shows a local (--showlocals): cut to `maxsize`, never raising."""
    from _pytest._io.saferepr import saferepr as pytests

    return pytests(value, maxsize=maxsize)


def fail_as_async() -> None:
    """Raise pytest's failure for a coroutine test run without an async plugin (pytest
    before 8.4 warns and skips such a test instead: so does a rank there)."""
    import _pytest.python

    fail: Any = getattr(_pytest.python, "async_fail", None)
    if fail is None:  # pytest < 8.4: its skip and words (its warning is the pytest side's)
        pytest.skip("async def functions are not natively supported and have been skipped.")
    fail("")


def option_flags(config: pytest.Config) -> dict[str, str]:
    """Each command-line flag of the session ("--rank-timeout") and the option it sets, as
    ``request.config.getoption("--flag")`` reads them."""
    parser: Any = config._parser
    found = getattr(parser, "_opt2dest", None)
    if isinstance(found, dict):
        return dict(found)
    flags: dict[str, str] = {}  # pytest before 8.1 keeps them only on each option
    groups = [getattr(parser, "_anonymous", None), *getattr(parser, "_groups", [])]
    for group in groups:
        for option in getattr(group, "options", []):
            for name in option.names():
                flags[name] = option.dest
    return flags


def log_level(config: pytest.Config, setting: str) -> int | None:
    """The log level a pytest setting (log_level, --log-level) names, as pytest reads it."""
    from _pytest.logging import get_log_level_for_setting

    return get_log_level_for_setting(config, setting)


def log_ini(config: pytest.Config, name: str) -> Any:
    """A logging option or its ini value (log_format, log_date_format, ...), as pytest reads it."""
    from _pytest.logging import get_option_ini

    return get_option_ini(config, name)


def logging_plugin() -> types.ModuleType:
    """pytest's logging plugin module: its handler, formatter and caplog, for a rank to
    capture log records as pytest captures a test's."""
    from _pytest import logging

    return logging


def capture_class(kind: str) -> Any:
    """pytest's capture class named `kind` (SysCapture, FDCapture, ...), for capsys and
    capfd made in a rank."""
    from _pytest import capture

    return getattr(capture, kind)


def legacy_path(path: Path) -> Any:
    """The py.path-style object pytest gives `tmpdir`."""
    from _pytest.compat import legacy_path as pytests

    return pytests(path)


def apply_warning_filters(config: tuple[str, ...], cmdline: tuple[str, ...]) -> None:
    """pytest's own application of ini and -W warning filters."""
    from _pytest.config import apply_warning_filters as pytests

    pytests(config, cmdline)


def parse_warning_filter(arg: str, escape: bool) -> tuple[Any, ...]:
    """A warning filter parsed as pytest parses it."""
    from _pytest.config import parse_warning_filter as pytests

    return tuple(pytests(arg, escape=escape))


def rewrite_asserts(tree: ast.Module, source: bytes, file: str) -> bool:
    """Rewrite the asserts of a test module's tree as pytest does; False where this pytest
    has no rewriter to lend."""
    try:
        from _pytest.assertion.rewrite import rewrite_asserts as pytests
    except ImportError:  # pragma: no cover - pytest is always there in a rank
        return False
    pytests(tree, source, file, None)
    return True


def assertion_util() -> types.ModuleType:
    """pytest's assertion helpers: its comparisons and the hook rewritten asserts call."""
    from _pytest.assertion import util

    return util


def null_terminal_writer() -> Any:
    """A terminal writer that writes nowhere (a quiet launched rank's report)."""
    import os

    from _pytest._io import TerminalWriter

    return TerminalWriter(open(os.devnull, "w"))


def junit_xml_key() -> Any:
    """The config stash key of pytest's junit xml writer, or None where junitxml moved."""
    try:
        from _pytest.junitxml import xml_key
    except ImportError:
        return None
    return xml_key
