"""One ranks test in a launched session: every launched process runs the body in-process,
then every rank reads every rank's outcome (``runner`` reaches the one verdict from them).

Used only in a launched session (it imports torch).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pytest
import torch.distributed as dist

from harness.common import endings, environment, reaper
from harness.common.errors import HarnessError
from harness.common.faults import Fault, Injector
from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import RankSpec
from harness.common.report_text import failure_text, ranks_phrase
from harness.launched.exchange import OutcomeExchange
from harness.launched.fate import Fate
from harness.launched.link import Link
from harness.launched.nodes import Nodes
from harness.launched.position import Position
from harness.launched.session import ARRIVE_S, OUTCOME_GRACE_S
from harness.launched.session_group import SessionGroup
from harness.launched.voice import Voice
from harness.launched.watch import HangTimer, Watch, Where
from harness.plan import timeout_interop
from harness.rank.body import run_body

endings.skip_frames_of(__file__)


class Running(Protocol):
    """What a launched test's run reads of the session: its parts, each used as it is."""

    rank: int
    world_size: int
    backend: str
    position: Position
    fate: Fate
    nodes: Nodes
    group: SessionGroup
    voice: Voice
    watch: Watch

    @property
    def link(self) -> Link: ...

    @property
    def outcomes(self) -> OutcomeExchange: ...


_key_key = pytest.StashKey[str]()
GROUP_DESTROYED = "the test destroyed the session's process group (set up again for the next)"
# Endings after which the group is still good for the next test.
_CLEAN = (Ending.RETURNED, Ending.SKIPPED, Ending.XFAILED)


def skip_reason(session: Running, spec: RankSpec, gpu_marked: bool) -> str | None:
    """Why this test cannot run in this launch (the same answer on every rank), or None."""
    if spec.world_size != session.world_size:
        return f"needs {spec.world_size} ranks, launched with {session.world_size}"
    if spec.backend == "nccl" and session.backend != "nccl":
        return "needs the nccl backend, launched with gloo (no GPU for each local rank)"
    if gpu_marked and session.backend != "nccl":
        return "needs GPUs; this launch runs on gloo (no GPU for each local rank)"
    return None


def before_set_up(item: pytest.Item, session: Running, spec: RankSpec) -> None:
    """Name this test's store keys and give it its group (none for launch=True)."""
    key = session.position.test_key()
    item.stash[_key_key] = _start_run(session, item.nodeid, spec, key, test_start=True)


def _start_run(session: Running, nodeid: str, spec: RankSpec, key: str, test_start: bool) -> str:
    if spec.launch:
        session.group.set_aside()  # the test sets its own up, from torchrun's environment
    elif not (
        found := session.group.agree(
            session.link, key, ARRIVE_S, spec.fresh_group, test_start=test_start
        )
    ).has_every_value:
        raise HarnessError(
            f"harness error: not every launched rank reached the set-up of {nodeid} "
            f"({found.absent_text()}); the test body never ran",
            pytrace=False,
        )
    return key


def agree_on_set_up(
    item: pytest.Item, session: Running, spec: RankSpec, error: BaseException | None
) -> None:
    """Start the body only where every rank's fixtures were set up; else every rank stops.

    A rank that ran the body while a peer's set-up failed would wait for it in the first
    collective until the timeout.
    """
    key = item.stash[_key_key]
    said = "" if error is None else _said(error)
    if error is not None and type(error).__name__ != "Skipped":
        session.group.drop()  # peers blocked in a fixture's collective on this rank fail now
    with timeout_interop.pytest_timeout_paused(item):  # a slow peer's set-up is its own to time
        found = session.link.gather(f"{key}/setup", said, ARRIVE_S)
    by_rank = {
        r: (blob.decode(errors="replace") if blob is not None else None)
        for r, blob in enumerate(found.values)
    }
    failed = {r: s for r, s in by_rank.items() if s}
    if not found.has_every_value:
        absent = found.absent_text()
        session.fate.lose(found.absent)
        session.fate.stop(f"ranks out of step at {item.nodeid} ({absent})", item.session)
        pytest.fail(f"not every rank finished setting up ({absent})", pytrace=False)
    skips = {r: s for r, s in failed.items() if s.startswith("skip:")}
    errors = {r: s for r, s in failed.items() if r not in skips}
    if errors and (error is None or session.rank in skips):
        first = min(errors)
        if skips or error is None:
            session.group.drop()  # the group may be mid-collective on the failed rank
        pytest.fail(
            f"rank {first}'s set-up failed ({errors[first]}); rank {session.rank} did not run "
            f"the body: every rank must set up alike",
            pytrace=False,
        )
    if error is not None:
        return  # this rank raises its own error (or skip, when every rank skipped)
    if skips and len(skips) < session.world_size:
        pytest.fail(
            f"{ranks_phrase(sorted(skips))} skipped in set-up ({next(iter(skips.values()))}) while "
            f"the others set up: skip on every rank or on none",
            pytrace=False,
        )


def _said(error: BaseException) -> str:
    if type(error).__name__ == "Skipped":
        return f"skip: {getattr(error, 'msg', error)}"
    return f"{type(error).__name__}: {error}".strip() or type(error).__name__


def run_test(item: pytest.Function, session: Running, spec: RankSpec) -> list[RankOutcome]:
    """Run the body here and exchange outcomes: every rank's, for the one verdict."""
    key = item.stash[_key_key]
    kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    return _run_everywhere(session, key, spec, item, lambda: item.obj(**kwargs))


def run_call(
    session: Running,
    node: pytest.Item,
    spec: RankSpec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[RankOutcome]:
    """run_on_ranks under a launch: `fn` on every launched rank, in-process; every rank gets
    every rank's outcome."""
    reason = skip_reason(session, spec, gpu_marked=False)
    if reason is not None:
        pytest.skip(f"run_on_ranks: {reason}")
    key = _start_run(session, node.nodeid, spec, session.position.call_key(), test_start=False)
    return _run_everywhere(session, key, spec, node, lambda: fn(*args, **kwargs))


def _run_everywhere(
    session: Running,
    key: str,
    spec: RankSpec,
    node: pytest.Item,
    call: Callable[[], Any],
) -> list[RankOutcome]:
    started = time.monotonic()  # the hang timer's clock too: both count from the body's start
    outcome, group_ok = _run_here(node, session, spec, key, call, started)
    if outcome.ending not in _CLEAN or not group_ok:
        session.group.drop()  # peers blocked on this rank fail now, not at their timeout
    if not group_ok:
        outcome = outcome.noted(GROUP_DESTROYED)
    left = spec.timeout_s - (time.monotonic() - started)
    # Past the test's body, said as the outcome is published: a peer still waiting in a
    # run_on_ranks call of this test stops.
    finishing = key == session.position.test_key()
    outcomes = session.outcomes.exchange(key, outcome, max(left, 0.0) + OUTCOME_GRACE_S, finishing)
    _after(node, session, outcomes)
    return outcomes


def _after(item: pytest.Item, session: Running, outcomes: list[RankOutcome]) -> None:
    """Drop the group on every rank when any rank's run broke it; end the session after a
    hang or a lost rank, or when the launcher is stopping the job."""
    if any(o.ending not in _CLEAN or GROUP_DESTROYED in o.notes for o in outcomes):
        session.group.drop()
    for o in outcomes:
        if o.ending is Ending.HUNG:  # either way the rank is stuck, and cannot be replaced
            why = "it hung waiting on a peer (collateral)" if o.looks_collateral else "it hung"
            session.fate.lose_unless_known(o.rank, why)
    if 0 in session.fate.lost or session.link.peers.lost:
        session.voice.speak_for_rank_0(session.fate, session.nodes, session.link.peers.lost)
    if any(o.ending is Ending.LOST for o in outcomes):
        session.voice.tell_node(session.nodes, item.nodeid, failure_text(outcomes) or "")
    reasons = session.fate.lost_reasons()
    if session.link.peers.stopping:
        reasons.append("the launcher is stopping the job")
    if reasons:
        session.fate.stop(
            f"the session ends after {item.nodeid} ({'; '.join(reasons)}): a launched rank "
            f"cannot be replaced",
            item.session,
        )


def _run_here(
    item: pytest.Item,
    session: Running,
    spec: RankSpec,
    key: str,
    call: Callable[[], Any],
    started: float,
) -> tuple[RankOutcome, bool]:
    """The body run here, through the one body runner every kind of rank uses; its
    outcome, and whether the session's group is still good for the next test."""
    outcome, _before = run_body(
        key, session.rank, spec, LaunchedBody(item, session, spec, key, call), started
    )
    group_ok = spec.launch or session.group.is_default()
    environment.put_back()  # as a warm rank does; changed variables are only reported here
    return outcome, group_ok


class LaunchedBody:
    """A test body as a launched rank runs it (see rank/body.py's Body): pytest has made its
    fixtures in this process already and captures its logs; the hang timer bounds it."""

    reraised: tuple[type[BaseException], ...] = (KeyboardInterrupt,)  # every rank stops alike

    def __init__(
        self,
        item: pytest.Item,
        session: Running,
        spec: RankSpec,
        key: str,
        call: Callable[[], Any],
    ) -> None:
        self._item, self._session, self._spec, self._key = item, session, spec, key
        self._call = call
        # A launch=True body's own group is its leftover; one its fixtures set up is theirs.
        self._fixtures_group = dist.group.WORLD if spec.launch and dist.is_initialized() else None
        self._children = set(reaper.leftovers(os.getpid()))  # session fixtures': not the test's

    def load(self) -> tuple[Fault, ...]:
        return self._spec.faults_on(self._session.rank)

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        where = Where()
        with (
            HangTimer(self._session.watch, self._key, self._spec.timeout_s, where),
            where.installed(),
        ):
            yield

    def call(self, injector: Injector) -> Any:
        injector.at_start()
        return self._call()

    def finish(self) -> None:
        pass  # pytest tears the fixtures down itself

    def after_raise(self, outcome: RankOutcome) -> RankOutcome:
        return outcome  # the session drops its group once every rank's outcome is known

    def after_body(self, outcome: RankOutcome) -> tuple[RankOutcome, bool]:
        out, err = _captured(self._item.config)  # for rank 0's report
        outcome = outcome.with_output(out, err)
        left = (
            self._spec.launch
            and dist.is_initialized()
            and dist.group.WORLD is not self._fixtures_group
        )
        if left:
            self._session.group.drop()
        return outcome, left

    def children_before(self) -> set[int]:
        return self._children

    def env_before(self, env: dict[str, str]) -> dict[str, str]:
        return _unpatched(env, self._item)


def _captured(config: pytest.Config) -> tuple[str, str]:
    """What the body printed, taken from pytest's capture to travel to rank 0's report."""
    capman: Any = config.pluginmanager.getplugin("capturemanager")
    with contextlib.suppress(Exception):
        out, err = capman.read_global_capture()
        return str(out), str(err)
    return "", ""


def _unpatched(env: dict[str, str], item: pytest.Item) -> dict[str, str]:
    """`env` as if the test's monkeypatch had set or deleted its variables beforehand: it
    undoes them at teardown, after this check, so they are not the test's leftovers."""
    patch = getattr(item, "funcargs", {}).get("monkeypatch")
    names = {name for where, name, _ in getattr(patch, "_setitem", ()) if where is os.environ}
    env = {name: value for name, value in env.items() if name not in names}
    return env | {name: os.environ[name] for name in names if name in os.environ}
