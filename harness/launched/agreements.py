"""What every rank of a launched session agrees on before and after its tests: the backend
(and the session's own store prefix), the tests collected, and one exit status.

Each agreement gathers every rank's word through the launch's store (bounded by AGREE_S); a
disagreement ends the session on every rank alike, saying what differed and what to do.
Used only in a launched session.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol

import pytest
import torch

from harness.common.launch_detect import Launch
from harness.common.report_text import ranks_phrase
from harness.launched import records, terminal
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.link import Link
from harness.launched.nodes import Nodes
from harness.launched.position import Position
from harness.launched.session import AGREE_S
from harness.launched.store import store_is_here
from harness.plan import seeds
from harness.plan.settings import settings_of, use_seed


class Agreeing(Protocol):
    """What the agreements read of the launched session, and the steps they take on it."""

    rank: int
    config: pytest.Config
    launch: Launch
    backend: str
    position: Position
    fate: Fate
    nodes: Nodes

    @property
    def link(self) -> Link: ...

    def placed(self, nodes: Nodes) -> None: ...

    def watch_crashes(self) -> None: ...

    def over(self, status: int) -> None: ...


# What each rank says of itself at the start (see agree_on_backend).
_WORD: dict[str, type | tuple[type, ...]] = {
    "backend": str,
    "seed": int,
    "source": str,
    "nonce": str,
    "torch": str,
    "rankwise": str,
    "node": str,
    "store": bool,
}


def agree_on_backend(launched: Agreeing) -> None:
    """Every rank must use the same backend (GPUs may differ between nodes) and the same
    torch and rankwise, and seeds its generators from rank 0's session seed. Each rank says
    which node it runs on and whether that node holds the launch's store (what a lost node
    is named by), and gives a random word: the session goes on under a prefix made from
    them all."""
    seed = settings_of(launched.config).seed
    mine = {
        "backend": launched.backend,
        "seed": seed.value,
        "source": seed.source,
        "nonce": launched.link.peers.nonce,
        "torch": str(torch.__version__),
        "rankwise": _rankwise_version(),
        "node": launched.launch.node_name,
        "store": store_is_here(launched.launch),
    }
    found = launched.link.gather("backend", json.dumps(mine), AGREE_S)
    if not found.complete:
        why = _absent_by_node(launched, found)
        end_session(launched, f"harness: not every launched rank started its session ({why})")
    words = [_word(launched, r, blob) for r, blob in enumerate(found.values)]
    said = {r: str(w["node"]) for r, w in enumerate(words) if w}
    store_node = next((str(w["node"]) for w in words if w and w["store"]), "")
    launched.placed(Nodes(launched.launch, said, store_node))
    _agree_on(launched, words, "backend", "give every rank the same --rank-backend")
    for package in ("torch", "rankwise"):
        _agree_on(launched, words, package, f"install the same {package} on every node")
    if words[0]:
        use_seed(launched.config, seeds.SessionSeed(words[0]["seed"], words[0]["source"]))
    launched.link.peers.freshen([str(w["nonce"]).encode() if w else b"" for w in words])
    launched.link.put(f"pid/{launched.rank}", str(os.getpid()))  # under the fresh prefix too
    launched.link.peers.say_place()
    joined = launched.link.gather("fresh", "1", AGREE_S)
    if not all(joined.values):
        why = joined.absent_text()
        end_session(
            launched,
            f"harness: not every rank joined the session's own prefix ({why}); unless "
            f"those ranks ended, they were shown another rank's word replaced by a process "
            f"that reaches the launch's store (see docs/security.md)",
        )
    launched.watch_crashes()


def _absent_by_node(launched: Agreeing, found: Gathered) -> str:
    """'node 1 (ranks 2, 3): no sign of life ...', each node's absent ranks together where
    they are absent for the same reason (the node went), else rank by rank."""
    by_node: dict[tuple[str, str], list[int]] = {}
    for r, why in sorted(found.absent.items()):
        reason = re.sub(r"\d+(\.\d+)? s\b", "some seconds", why)  # alike across a node
        by_node.setdefault((launched.nodes.node_of(r), reason), []).append(r)
    return "; ".join(
        f"{node + ' (' if node else ''}{ranks_phrase(ranks)}{')' if node else ''}: {why}"
        for (node, why), ranks in by_node.items()
    )


def _word(launched: Agreeing, rank: int, blob: bytes | None) -> dict[str, Any]:
    """What `rank` said of itself at the start; {} where it said nothing of the harness's
    (its seed is then not taken, nor its node named)."""
    if blob is None:
        return {}
    try:
        word = records.read_json(blob, f"backend/{rank}", _WORD)
    except records.RecordError as exc:
        terminal.loud(launched.config, f"harness: ignored {exc} (not this harness's)")
        return {}
    if word["source"] not in ("pytest-randomly", "--rank-seed", "drawn"):
        return {}
    return word


def _agree_on(launched: Agreeing, words: list[dict[str, Any]], field: str, fix: str) -> None:
    """End the session, on every rank alike, where the ranks said different `field`s: each
    value with the ranks (and nodes) that said it."""
    said: dict[str, list[int]] = {}
    for r, word in enumerate(words):
        said.setdefault(str(word.get(field, "nothing")), []).append(r)
    if len(said) < 2:
        return
    each = "; ".join(
        f"{field} {value} on {ranks_phrase(ranks)} ({launched.nodes.named(ranks)})"
        for value, ranks in said.items()
    )
    end_session(launched, f"harness: the launched ranks differ: {each}; {fix}")


def _rankwise_version() -> str:
    try:
        return version("rankwise")
    except PackageNotFoundError:  # the checkout on sys.path, not installed
        return "unknown"


def agree_on_collection(launched: Agreeing, items: Sequence[pytest.Item]) -> None:
    """Every rank must have collected the same tests, in the same order, and without
    errors: pytest stops a rank that could not collect, and its peers would wait for it
    in the first test."""
    mine = [item.nodeid for item in items]
    launched.position.collect(mine)
    said = {"tests": mine, "errors": _collection_errors(launched.config)}
    found = launched.link.gather("collected", json.dumps(said), AGREE_S)
    differences: dict[tuple[str, str], list[int]] = {}
    errors, unfinished = [], []
    for r, blob in enumerate(found.values):
        if blob is None:
            unfinished.append(f"rank {r} did not finish collecting: {found.why(r)}")
            continue
        try:
            theirs = records.read_json(blob, f"collected/{r}", {"tests": list, "errors": list})
        except records.RecordError as exc:
            unfinished.append(f"rank {r}'s collection could not be read: {exc}")
            continue
        said_by_r = [f"rank {r} could not collect {text}" for text in theirs["errors"]]
        errors += said_by_r
        if r != launched.rank:
            launched.fate.note_peer_collection_errors(said_by_r)
        if theirs["tests"] != mine:
            what = _collection_difference(theirs["tests"], launched.rank, mine)
            differences.setdefault((launched.nodes.node_of(r), what), []).append(r)
    if errors and not launched.config.getoption("continue_on_collection_errors", False):
        end_session(
            launched,
            f"harness: {len(errors)} collection error(s) on the launched ranks; every rank "
            f"stops, as pytest stops for one (make the test files import alike on every "
            f"node):\n" + "\n".join(errors),
        )
    if unfinished:
        end_session(
            launched,
            f"harness: {'; '.join(unfinished)}. It ended or hung while collecting, before "
            f"any test ran: its own output (stderr) and the launcher's summary say why",
        )
    if differences:
        each = "; ".join(
            f"{ranks_phrase(ranks)}{f' ({node})' if node else ''} collected {what}"
            for (node, what), ranks in differences.items()
        )
        end_session(
            launched,
            f"harness: the launched ranks collected different tests: {each}"
            f". Every rank must collect the same tests: make collection independent of the "
            f"node (its GPUs, files, environment, random seeds) and select the same tests "
            f"everywhere (a --lf cache each node keeps for itself differs)",
        )


def agree_on_exit(launched: Agreeing, session: pytest.Session) -> None:
    """Every rank ends with one status: rank 0's, or the worst any rank reached."""
    status = int(session.exitstatus)
    launched.position.at_the_end()  # past every test: the end's keys are not deleted
    mine = {"status": status, "failed": _failed(session)}
    found = launched.link.gather("status", json.dumps(mine), AGREE_S, follow_exits=False)
    if launched.rank == 0:
        final = _final(launched, found, mine)
        launched.link.put("final", str(final))
    elif 0 in launched.fate.lost or launched.link.peers.lost:
        final = status or int(pytest.ExitCode.TESTS_FAILED)  # rank 0's loss is a failure
    else:
        blob = launched.link.get("final", AGREE_S)
        if blob is None:
            terminal.loud(
                launched.config,
                f"harness: rank {launched.rank} could not learn rank 0's exit status (rank 0 "
                f"did not publish it); it exits with its own ({status})",
            )
            final = status
        else:
            final = records.read_int(blob, "final", status)
    session.exitstatus = final
    launched.over(final)


def _final(launched: Agreeing, found: Gathered, mine: dict[str, Any]) -> int:
    statuses = [mine["status"]]
    for r, blob in enumerate(found.values):
        if r == 0 or r == launched.rank:
            continue
        if blob is None:  # it never said how its session ended: it did not end well
            statuses.append(int(pytest.ExitCode.TESTS_FAILED))
            continue
        try:
            said = records.read_json(blob, f"status/{r}", {"status": int})
        except records.RecordError as exc:  # not a rank's word: the session did not end well
            terminal.loud(launched.config, f"harness: {exc}; counted as a failed session")
            statuses.append(int(pytest.ExitCode.TESTS_FAILED))
            continue
        statuses.append(said["status"])
    if launched.fate.lost:
        statuses.append(int(pytest.ExitCode.TESTS_FAILED))
    bad = [s for s in statuses if s != 0]
    return mine["status"] if mine["status"] != 0 else (bad[0] if bad else 0)


def end_session(launched: Agreeing, message: str) -> None:
    """Stop the whole session now, on every rank alike (each rank finds the same problem)."""
    launched.over(int(pytest.ExitCode.INTERRUPTED))
    raise pytest.exit(message, returncode=pytest.ExitCode.INTERRUPTED)


COLLECTION_ERROR_CHARS = 2000  # of each error's report, its end (where the error is)


def _collection_errors(config: pytest.Config) -> list[str]:
    """This rank's collection errors so far: where, and the end of pytest's report; and the
    exception that is stopping its collection, if one is (pytest reports the collection on
    its way out, and a SystemExit in a module's import stops it with no error report)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reports = [] if reporter is None else reporter.stats.get("error", [])
    errors = [
        f"{report.nodeid or '(the session)'}:\n{report.longreprtext[-COLLECTION_ERROR_CHARS:]}"
        for report in reports
        if isinstance(report, pytest.CollectReport) and report.failed
    ]
    stopping = sys.exc_info()[1]
    if stopping is not None:
        text = _without_pytests_frames(stopping)
        errors.append(f"(the collection stopped):\n{text[-COLLECTION_ERROR_CHARS:]}")
    return errors


def _without_pytests_frames(exc: BaseException) -> str:
    """`exc`'s traceback with the frames of pytest, pluggy and the import system left out."""
    shown = traceback.TracebackException.from_exception(exc)
    internal = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}", "importlib")
    frames = [f for f in shown.stack if not any(part in f.filename for part in internal)]
    shown.stack = traceback.StackSummary.from_list(frames)
    return "".join(shown.format())


def _collection_difference(theirs: list[str], me: int, mine: list[str]) -> str:
    extra = [n for n in theirs if n not in set(mine)]
    missing = [n for n in mine if n not in set(theirs)]
    parts = []
    if extra:
        parts.append(f"{len(extra)} test(s) rank {me} did not ({', '.join(extra[:5])})")
    if missing:
        parts.append(f"not {len(missing)} test(s) rank {me} did ({', '.join(missing[:5])})")
    if not parts:
        parts.append(f"the same tests in another order than rank {me}")
    return " and ".join(parts)


def _failed(session: pytest.Session) -> list[str]:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return []
    reports = reporter.stats.get("failed", []) + reporter.stats.get("error", [])
    return sorted({getattr(r, "nodeid", "") for r in reports})
