"""What a launched rank shows on the terminal: ranks other than 0 are quiet (rank 0 speaks
for every rank), words that must be seen go past pytest's capture, and rank 0's summary of a
session that ended early.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

from harness.common import pytest_internals
from harness.common.report_text import ranks_phrase


def quiet(config: pytest.Config) -> Any:
    """Ranks other than 0 print no report and write no junit or cache: rank 0 speaks for all.
    Returns the terminal writer it silenced."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    real = None
    if reporter is not None:
        real = reporter._tw
        reporter._tw = pytest_internals.null_terminal_writer()
    # Report files are off here already (reports.py), unless the harness was loaded
    # after pytest configured its junit writer (from a conftest's pytest_plugins).
    xml_key = pytest_internals.junit_xml_key()
    xml = None if xml_key is None else config.stash.get(xml_key, None)
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


def summary(
    reporter: Any,
    *,
    unsigned: bool,
    refused: list[str],
    peer_collection_errors: list[str],
    stop_reason: str,
    not_run: list[str],
) -> None:
    """Rank 0's last words: whether the session ran unsigned and which store values failed
    the signature check, collection errors on other ranks, and why the session ended early
    (`stop_reason`, with the tests it did not run)."""
    _signatures(reporter, unsigned, refused)
    going_on = reporter.config.getoption("continue_on_collection_errors", False)
    if peer_collection_errors and going_on:  # theirs, not shown (else in the exit)
        reporter.write_sep("=", "harness: collection errors on other ranks", red=True)
        for text in peer_collection_errors:
            reporter.write_line(text)
    if not stop_reason:
        return
    reporter.write_sep("=", "harness: the session ended early", red=True)
    reporter.write_line(stop_reason)
    reporter.write_line(f"tests not run ({len(not_run)}):")
    for nodeid in not_run:
        reporter.write_line(f"  {nodeid}")


def _signatures(reporter: Any, unsigned: bool, refused: list[str]) -> None:
    """Say whether the session's values in torchrun's store were signed, and which values
    failed the check (ignored, never believed)."""
    if unsigned:
        reporter.write_line(
            "harness: this launched session ran unsigned (no HARNESS_SECRET or "
            "--rank-secret-file): a process that reaches the launch's store could change a "
            "verdict, though never run code here; see docs/security.md",
            yellow=True,
        )
    if refused:
        reporter.write_sep("=", "harness: values that failed the signature check", red=True)
        reporter.write_line(
            f"ignored {len(refused)} value(s) in the launch's store not signed with this "
            f"session's secret (another process writes there, or a rank was given another "
            f"secret): {', '.join(refused[:10])}"
        )


def stop_report(
    current: str, world_size: int, gone: dict[int, str], placement: dict[int, str]
) -> str:
    """The reporting rank's words on a job the launcher stopped during `current` (or between
    tests): the ranks in `gone` ended first, each with what it said as it died ("" if
    nothing); a node all of whose ranks went silently is named as lost. Under a test, its
    first line is the test's verdict, as pytest's summary words it."""
    lost = _lost_nodes(gone, placement)
    lost_ranks = {r for ranks in lost.values() for r in ranks}
    stopped = [r for r in range(world_size) if r not in gone]
    causes = [f"{node} was lost ({ranks_phrase(ranks)})" for node, ranks in lost.items()]
    causes += [f"rank {r} ended first" for r in sorted(gone) if r not in lost_ranks]
    headline = "; ".join(causes) or "every rank was stopped by it"
    lines = [f"FAILED {current} - the launcher stopped the job: {headline}"] if current else []
    during = f"during {current}" if current else "between tests"
    lines.append(f"harness: the launcher stopped the job {during}.")
    for node, ranks in lost.items():
        lines.append(
            f"  {node} was lost: {ranks_phrase(ranks)} ended first, none with a word (the node "
            f"went down, or the processes on it were killed)"
        )
    for rank, cause in sorted(gone.items()):
        if rank not in lost_ranks:
            cause = cause or "it left no word (the launcher's summary has its exit status)"
            lines.append(f"  rank {rank} ended first: {cause}")
    if gone:
        verb = "was" if len(stopped) == 1 else "were"
        lines.append(f"  {ranks_phrase(stopped)} {verb} stopped by the launcher")
    else:
        lines.append("  every rank was stopped by it (a cancelled job, or a rank's own exit)")
    return "\n".join(lines)


def _lost_nodes(gone: dict[int, str], placement: dict[int, str]) -> dict[str, list[int]]:
    """The nodes every rank of which is in `gone` with no word of its own, with their ranks."""
    nodes: dict[str, list[int]] = {}
    for rank, node in sorted(placement.items()):
        nodes.setdefault(node, []).append(rank)
    return {
        node: ranks
        for node, ranks in nodes.items()
        if all(r in gone and not gone[r] for r in ranks)
    }
