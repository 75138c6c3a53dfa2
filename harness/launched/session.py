"""A pytest session that torchrun (or another launcher) started once per rank.

There the harness starts no process: every launched pytest process is one rank. The session
keeps one process group made from the launch, runs each ranks test's body in-process on every
rank, and talks to the other ranks through the launch's store (every wait bounded):

- at the start, ranks agree on the backend and on the tests they collected;
- around each test, on their set-up and then on every rank's outcome, so every rank reaches
  the same verdict; only rank 0 prints it and writes junit, the others are quiet;
- at the end, on one exit status.

A rank that hangs or dies cannot be replaced in-process: ``watch`` reports it and
the session ends there. Imported only in a launched session (it imports torch).

The session is built once and hands out its parts, each a module of its own: where this rank
is (position.py), which node each rank runs on (nodes.py), what becomes of the session
(fate.py), the session's process group (session_group.py), who speaks and where (voice.py),
and once connected the line to the store (link.py, which also says where this rank is) and
the outcome exchange (exchange.py). Its own methods are what no part owns alone: connecting,
the ranks' placement, a death or a stop noted, the stop's report, and the session's end.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
from typing import Any

import pytest

from harness.common.launch_detect import Launch
from harness.common.report_text import failure_text
from harness.launched import terminal
from harness.launched.crashes import Crashes
from harness.launched.exchange import OutcomeExchange
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.link import Link
from harness.launched.nodes import Nodes
from harness.launched.position import Position
from harness.launched.session_group import SessionGroup
from harness.launched.store import (
    ForeignStore,
    Peers,
    first_line,
    store_gone,
)
from harness.launched.voice import Voice
from harness.launched.watch import Watch
from harness.plan.settings import session_timeout, settings_of

# Bound on the session-level agreements (backend, collection, exit status): ranks reach them
# at about the same time, but collection on a busy node can take a while.
AGREE_S = 300.0
# How long a rank waits for live peers to arrive at a test or finish its set-up: ranks run
# fixtures and tests without ranks each on their own, so one may be slower than another.
ARRIVE_S = 600.0
# How long past a test's timeout a rank waits for its peers' outcomes: their own timers fire
# at the timeout and need a moment to dump stacks and publish.
OUTCOME_GRACE_S = 15.0
# How long a rank tries to reach the launch's store at the start, at least (or the tests'
# timeout, if longer): it is there before the ranks start (torchrun's agent hosts it; rank 0
# makes it as it starts, under srun or mpirun).
CONNECT_S = 60.0


def start(config: pytest.Config, launch: Launch, backend: str) -> LaunchedSession:
    """This rank's session, built: ranks other than 0 quiet (their terminal writer kept to
    speak with), each with a --basetemp of its own."""
    quiet_writer = terminal.quiet(config) if launch.rank != 0 else None
    _own_basetemp(config, launch.rank)
    return LaunchedSession(config, launch, backend, quiet_writer)


def _own_basetemp(config: pytest.Config, rank: int) -> None:
    """--basetemp is emptied by every process that uses it: give each rank its own below it."""
    factory = getattr(config, "_tmp_path_factory", None)
    given = getattr(factory, "_given_basetemp", None)
    if factory is not None and given is not None:
        given.mkdir(parents=True, exist_ok=True)  # pytest makes only the last level
        factory._given_basetemp = given / f"rank{rank}"


class LaunchedSession:
    """This rank's launched session: its parts (`position`, `nodes`, `fate`, `group`,
    `voice`, and once connected `link` and `outcomes`), and what takes more than one."""

    def __init__(
        self, config: pytest.Config, launch: Launch, backend: str, quiet_writer: Any = None
    ) -> None:
        self.config = config
        self.launch = launch
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.backend = backend
        self.position = Position()
        self.nodes = Nodes(launch)  # the launcher's numbering until the ranks say theirs
        self.fate = Fate()
        self.watch = Watch(self)  # its hang and launcher-stop paths
        self.voice = Voice(config, launch.rank, quiet_writer)  # who speaks, and where
        self.group = SessionGroup(launch, backend)
        self._link: Link | None = None  # the store's parts, once connected
        self._outcomes: OutcomeExchange | None = None
        self.crashes: Crashes | None = None  # the ranks beside this one, once placed

    # ---- the store ---------------------------------------------------------------------

    def connect(self) -> None:
        """Join the launch's store; start saying this rank is alive. A store this rank
        cannot reach within the test timeout (its node down, or the link to it) ends this
        rank's session, saying so."""
        bound = max(CONNECT_S, session_timeout(settings_of(self.config)))
        try:
            peers = Peers(self.launch, bound, settings_of(self.config).secret)
        except ForeignStore as exc:
            raise pytest.exit(
                f"harness: rank {self.rank} ({self.launch.node_name}): {exc}",
                returncode=pytest.ExitCode.USAGE_ERROR,
            ) from None
        except Exception as exc:
            if not store_gone(exc):
                raise
            where = f"{self.launch.master_addr}:{self.launch.master_port}"
            raise pytest.exit(
                f"harness: rank {self.rank} ({self.launch.node_name}) could not reach the "
                f"launch's store at {where} within {bound:g} s ({first_line(exc)}): the node "
                f"that holds it is down, or the link to it; the other ranks name this rank",
                returncode=pytest.ExitCode.INTERRUPTED,
            ) from None
        self._link = Link(peers, self.rank, self.position, self.fate, self.config)
        self._outcomes = OutcomeExchange(self._link, self.rank, self.fate, self.nodes)
        # A peer elsewhere that holds the GIL looks silent: no sooner gone than a test's bound.
        bound_s = session_timeout(settings_of(self.config))
        peers.follow(lambda: self.position.stage, self.position.name_of, bound_s)
        self.link.put(f"pid/{self.rank}", str(os.getpid()))  # for the report if this rank dies
        self.watch.start_heartbeat(peers)

    @property
    def connected(self) -> bool:
        return self._link is not None

    @property
    def link(self) -> Link:
        """Puts, gets and gathers through the launch's store (the session must be connected)."""
        assert self._link is not None, "the launched session is not connected"
        return self._link

    @property
    def outcomes(self) -> OutcomeExchange:
        """Every rank's outcome of a run (the session must be connected)."""
        assert self._outcomes is not None, "the launched session is not connected"
        return self._outcomes

    @property
    def _peers(self) -> Peers | None:
        return None if self._link is None else self._link.peers

    def ended_early(self, text: str, code: int) -> None:
        """This rank's session ends before its tests did (pytest.exit, KeyboardInterrupt):
        say why, leave the group (a peer blocked in a collective on this rank fails at
        once), and move past every test (a peer waiting for this rank's word stops)."""
        self.link.put(f"exit/{self.rank}", json.dumps({"text": text, "code": code}))
        self.group.drop()
        self.link.reach(self.position.past_every_test())

    # ---- outcomes and the end ------------------------------------------------------------

    def note_death(self, text: str, signum: int | None = None, code: int | None = None) -> None:
        """Say, before this process dies of something the harness knows (an injected fault),
        what it was; a SIGTERM it sends itself then ends it, as it would a warm rank."""
        with contextlib.suppress(ValueError):  # called from the body, on the main thread
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(Exception):
            self.link.put(
                f"died/{self.rank}", json.dumps({"text": text, "signal": signum, "code": code})
            )

    def watch_crashes(self) -> None:
        """From here a fatal signal on this node is named at once (see crashes.py): this
        rank's crash report goes to its file, and its heartbeat looks at the ranks beside it
        (same node, same machine and pid namespace)."""
        node = self.nodes.node_of(self.rank)
        peers = self.link.peers
        beside = {r: peers.pid_here(r) for r in self.nodes.ranks_on(node) if r != self.rank}
        crashes = Crashes(peers.prefix, self.rank, {r: p for r, p in beside.items() if p})
        crashes.watch_own()
        self.crashes = crashes

    def look_for_crashes(self) -> None:
        """A heartbeat's look at the ranks beside this one (see crashes.py)."""
        if self.crashes is not None and not self.fate.finished.is_set():
            say = functools.partial(terminal.loud, self.config)
            self.crashes.look(lambda r, said: self.link.put(f"died/{r}", said), say)

    def placed(self, nodes: Nodes) -> None:
        """The ranks said which node each runs on (see agreements.py)."""
        self.nodes = nodes
        self.outcomes.placed(nodes)

    def launcher_stopped(self) -> bool:
        """The launcher is stopping the job: waits end soon, and the main thread stops after
        this test. False when that is known already (or the session never connected)."""
        if self._peers is None or self._peers.stopping:
            return False
        self._peers.note_stopping()
        with contextlib.suppress(Exception):
            self.link.put(f"stopped/{self.rank}", self.position.current or "-")
        return True

    def stop_report(self, wait_s: float) -> str:
        """Rank 0's words on a job the launcher stopped: which ranks ended first (they said
        nothing within `wait_s` of being stopped), with what they said as they died."""
        others = [r for r in range(self.world_size) if r != self.rank]
        self.link.wait([f"stopped/{r}" for r in others], wait_s)
        if self.link.peers.lost:  # no rank's word arrives: say what is known, the lost node
            none = Gathered([None] * self.world_size)
            outcomes = [self.outcomes.missing(self.position.test_key(), r, none) for r in others]
            text = failure_text(outcomes) or f"the launch's store is gone ({self.link.peers.lost})"
            head = text.splitlines()[0]
            during = f"during {self.position.current}" if self.position.current else "between tests"
            verdict = f"FAILED {self.position.current} - {head}\n" if self.position.current else ""
            return f"{verdict}harness: the launcher stopped the job {during}: {text}"
        gone = {
            r: self.outcomes.died(r).get("text", "")
            for r in others
            if not self.link.peers.has(f"stopped/{r}")
        }
        return terminal.stop_report(
            self.position.current, self.world_size, gone, dict(self.nodes.said)
        )

    def over(self, status: int) -> None:
        """The session's end is agreed: from here this process exits with `status` on its own.

        With failures the launcher stops the job when the first rank exits; the others are
        past every report by then, so the launcher's SIGTERM is ignored from here (it would
        otherwise land in interpreter shutdown and end the rank as killed).
        """
        self.fate.over(status)
        with contextlib.suppress(ValueError):  # not the main thread: the handler still exits
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.crashes is not None:  # past every test: its report file goes (crashes.py)
            self.crashes.close()
