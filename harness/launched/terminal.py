"""What a launched rank shows on the terminal: ranks other than 0 are quiet (rank 0 speaks
for every rank), words that must be seen go past pytest's capture, and rank 0's summary of a
session that ended early.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.launched.session import LaunchedSession


def quiet(config: pytest.Config) -> Any:
    """Ranks other than 0 print no report and write no junit or cache: rank 0 speaks for all.
    Returns the terminal writer it silenced."""
    from _pytest._io import TerminalWriter

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    real = None
    if reporter is not None:
        real = reporter._tw
        reporter._tw = TerminalWriter(open(os.devnull, "w"))  # noqa: SIM115 - the session's
    # Report files are off here already (reports.py), unless the harness was loaded
    # after pytest configured its junit writer (from a conftest's pytest_plugins).
    with contextlib.suppress(ImportError):
        from _pytest.junitxml import xml_key

        xml = config.stash.get(xml_key, None)
        if xml is not None:
            del config.stash[xml_key]
            config.pluginmanager.unregister(xml)
    cache = getattr(config, "cache", None)
    if cache is not None:
        with contextlib.suppress(Exception):
            cache.set = lambda key, value: None  # rank 0 writes --lf's record, once
    return real


def loud(config: pytest.Config, text: str) -> None:
    """Write to the real terminal (past pytest's capture), whichever rank this is."""
    capman: Any = config.pluginmanager.getplugin("capturemanager")
    capturing = getattr(capman, "_global_capturing", None)
    err = getattr(capturing, "err", None)
    fd = getattr(err, "targetfd_save", 2)
    with contextlib.suppress(OSError):
        os.write(fd, (text.rstrip("\n") + "\n").encode(errors="replace"))


def summary(launched: LaunchedSession, reporter: Any) -> None:
    """Rank 0's last words: collection errors on other ranks, and why the session ended early."""
    if launched.real_writer is not None:
        return  # a quiet rank
    _signatures(launched, reporter)
    going_on = reporter.config.getoption("continue_on_collection_errors", False)
    if launched.peer_collection_errors and going_on:  # theirs, not shown (else in the exit)
        reporter.write_sep("=", "harness: collection errors on other ranks", red=True)
        for text in launched.peer_collection_errors:
            reporter.write_line(text)
    if not launched.stop_reason:
        return
    left = launched.not_run()
    reporter.write_sep("=", "harness: the session ended early", red=True)
    reporter.write_line(launched.stop_reason)
    reporter.write_line(f"tests not run ({len(left)}):")
    for nodeid in left:
        reporter.write_line(f"  {nodeid}")


def _signatures(launched: LaunchedSession, reporter: Any) -> None:
    """Say whether the session's values in torchrun's store were signed, and which values
    failed the check (ignored, never believed)."""
    peers = launched.peers
    if peers is None:
        return
    if peers.secret is None:
        reporter.write_line(
            "harness: this launched session ran unsigned (no HARNESS_SECRET or "
            "--rank-secret-file): a process that reaches torchrun's store could change a "
            "verdict, though never run code here; see docs/security.md",
            yellow=True,
        )
    if peers.refused:
        reporter.write_sep("=", "harness: values that failed the signature check", red=True)
        reporter.write_line(
            f"ignored {len(peers.refused)} value(s) in torchrun's store not signed with this "
            f"session's secret (another process writes there, or a rank was given another "
            f"secret): {', '.join(peers.refused[:10])}"
        )
