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
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rankwise.testing import write_launcher_error

from harness.common.launch_detect import Launch
from harness.common.outcome import Ending, RankOutcome, outcome_from_exitcode
from harness.common.report_text import failure_text
from harness.launched import records, terminal
from harness.launched.blame import blamed_rank, headline
from harness.launched.crashes import Crashes
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.nodes import Nodes
from harness.launched.position import Position
from harness.launched.store import (
    QUIET_AFTER_S,
    ForeignStore,
    Peers,
    first_line,
    store_gone,
)
from harness.launched.watch import Watch
from harness.plan.settings import session_timeout, settings_of
from harness.rank import group_release

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
# The group's own timeout stays past every test's bound, so the harness's timer fires first.
GROUP_TIMEOUT_MARGIN_S = 120.0


def start(config: pytest.Config, launch: Launch, backend: str) -> LaunchedSession:
    session = LaunchedSession(config, launch, backend)
    if launch.rank != 0:
        session.real_writer = terminal.quiet(config)
    _own_basetemp(config, launch.rank)
    return session


def _own_basetemp(config: pytest.Config, rank: int) -> None:
    """--basetemp is emptied by every process that uses it: give each rank its own below it."""
    factory = getattr(config, "_tmp_path_factory", None)
    given = getattr(factory, "_given_basetemp", None)
    if factory is not None and given is not None:
        given.mkdir(parents=True, exist_ok=True)  # pytest makes only the last level
        factory._given_basetemp = given / f"rank{rank}"


class LaunchedSession:
    """This rank's view of the launched session: its store, its group, where it is (its
    `position`), which node each rank runs on (`nodes`) and what became of it (`fate`)."""

    def __init__(self, config: pytest.Config, launch: Launch, backend: str) -> None:
        self.config = config
        self.launch = launch
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.backend = backend
        self.position = Position()
        self.nodes = Nodes(launch)  # the launcher's numbering until the ranks say theirs
        self.fate = Fate()
        self.watch = Watch(self)  # its hang and launcher-stop paths
        self.real_writer: Any = None  # this quiet rank's terminal writer, kept to speak with
        self.restore_rendezvous: Callable[[], None] = lambda: None  # torch's env:// handler
        self._peers: Peers | None = None
        self._group_timeout_s = GROUP_TIMEOUT_MARGIN_S
        self._hung: dict[str, RankOutcome] = {}  # the outcomes this rank's timer published
        self._group: Any = None  # the session's own default group, to tell it from others
        self._written: dict[int, list[str]] = {}  # this rank's keys, by test index
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
        self._peers = peers
        peers.position = lambda: self.position.stage
        peers.name_of = self.position.name_of
        # A peer elsewhere that holds the GIL looks silent: no sooner gone than a test's bound.
        peers.silent_elsewhere_s = session_timeout(settings_of(self.config))
        self.put(f"pid/{self.rank}", str(os.getpid()))  # for the report if this rank dies
        self.watch.start_heartbeat(peers)

    @property
    def connected(self) -> bool:
        return self._peers is not None

    @property
    def _store(self) -> Peers:
        """The launch's store, with its waits (the session must be connected)."""
        assert self._peers is not None, "the launched session is not connected"
        return self._peers

    @property
    def nonce(self) -> str:
        """This rank's random word for the session's own prefix (see agreements.py)."""
        return self._store.nonce

    def freshen(self, nonces: list[bytes]) -> None:
        """Go on under the prefix made from every rank's word."""
        self._store.freshen(nonces)

    def still_in_this_test(self, rank: int) -> bool:
        """Whether `rank` is alive and has not moved past this rank's place."""
        return self._store.still_in_this_test(rank)

    def in_torch_distributed(self, rank: int) -> bool:
        """Whether `rank`'s main thread is blocked in torch.distributed (as it said)."""
        return self._store.in_torch_distributed(rank)

    @property
    def stopping(self) -> bool:
        return self._peers is not None and self._peers.stopping

    def allow_silence(self, seconds: float) -> None:
        """A test bounded longer than the session's default: a peer elsewhere may be silent
        (its GIL held) that long before it counts as gone."""
        if self._peers is not None:
            self._peers.silent_elsewhere_s = max(self._peers.silent_elsewhere_s, seconds)

    def bound_groups(self, longest_test_s: float) -> None:
        """The session's groups time out only past the longest test's bound."""
        self._group_timeout_s = longest_test_s + GROUP_TIMEOUT_MARGIN_S

    def put(self, key: str, value: bytes | str) -> None:
        self._track(key)
        self._store.put(key, value)

    def _track(self, key: str) -> None:
        """Remember a test's own keys ("t<index>/..."), to delete them once all have read."""
        if key.startswith("t"):
            self._written.setdefault(self.position.index, []).append(key)

    def wait(self, keys: Sequence[str], seconds: float) -> bool:
        """Whether every key is set within `seconds` (a few once the job is stopping)."""
        return all(self.get(key, seconds) is not None for key in keys)

    def get(self, key: str, seconds: float) -> bytes | None:
        """The value rank 0 (or any one rank) published at `key`, waiting up to `seconds`."""
        return self._store.wait_for(key, seconds)

    def gather(
        self, name: str, value: bytes | str | None, seconds: float, follow_exits: bool = True
    ) -> Gathered:
        """Every rank's `value` under `name`, in rank order; None for a rank that did not
        publish (gone, moved on, or late past `seconds`), with its reason.

        A rank absent because it ended its session with pytest.exit() or KeyboardInterrupt
        ends this one alike (pytest.exit with its words and status), unless `follow_exits`
        is False (the session's end, where every rank is already stopping).
        """
        if value is not None:
            self._track(f"{name}/{self.rank}")
        found = self._store.gather(name, value, seconds, set(self.fate.lost))
        if found.complete:  # every rank is at this test: all have read the earlier tests' keys
            for old in [i for i in self._written if i < self.position.index]:
                self._store.drop(self._written.pop(old))
        if follow_exits:
            self._follow_an_exit(found)
        return found

    def ended_early(self, text: str, code: int) -> None:
        """This rank's session ends before its tests did (pytest.exit, KeyboardInterrupt):
        say why, leave the group (a peer blocked in a collective on this rank fails at
        once), and move past every test (a peer waiting for this rank's word stops)."""
        self.put(f"exit/{self.rank}", json.dumps({"text": text, "code": code}))
        self.drop_group()
        self.at(self.position.past_every_test())

    def _follow_an_exit(self, found: Gathered) -> None:
        for rank in sorted(found.absent):
            blob = self._store.read(f"exit/{rank}")
            if blob is not None and rank != self.rank:
                key = f"exit/{rank}"
                try:
                    said = records.read_json(blob, key, {"text": str, "code": int})
                except records.RecordError as exc:
                    terminal.loud(self.config, f"harness: ignored {exc} (not this harness's)")
                    continue
                raise pytest.exit(f"[rank {rank}] {said['text']}", returncode=said["code"])

    # ---- where every rank is -------------------------------------------------------------

    def begin(self, nodeid: str) -> None:
        """A test starts here (whether it will run, skip or fail): say so to the others."""
        self.at(self.position.begin(nodeid))

    def at(self, stage: int) -> None:
        """Say where this rank is, so a peer waiting on it elsewhere stops waiting."""
        self.position.stage = stage
        self.put(f"at/{self.rank}", str(stage))

    def finishing(self) -> None:
        """This rank is past the current test's body and calls: only its verdict is left."""
        self.at(self.position.finishing())

    def test_key(self) -> str:
        return self.position.test_key()

    def own_group_prefix(self) -> str:
        """The store prefix of the next group the current test sets up from torchrun's
        environment (see rendezvous.py): the test and how many came before."""
        return f"{self._store.prefix}/{self.position.own_group_key()}"

    def call_key(self) -> str:
        return self.position.call_key()

    @property
    def current(self) -> str:
        return self.position.current

    def not_run(self) -> list[str]:
        return self.position.not_run()

    # ---- the process group ---------------------------------------------------------------

    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", cuda_index(self.launch))
        return torch.device("cpu")

    def agree_on_group(self, key: str, seconds: float, fresh: bool) -> Gathered:
        """Every rank on the session's live group for run `key`: if any rank lacks it (a test
        destroyed it or replaced it, a plain test set it aside) or `fresh` is asked, every
        rank sets a new one up, under this run's keys. Without every rank's value when a rank
        did not come (then no group is set up)."""
        need = "1" if fresh or not self.has_group() else "0"
        found = self.gather(f"{key}/group", need, seconds)
        if not found.has_every_value:
            return found
        if any(flag == b"1" for flag in found.values):
            self.drop_group()
            store = dist.PrefixStore(f"{key}/group", self._store.store)  # type: ignore[attr-defined]
            self._init_group(store)
        return found

    def has_group(self) -> bool:
        return dist.is_initialized() and dist.group.WORLD is self._group

    def _init_group(self, store: Any) -> None:
        kwargs: dict[str, Any] = {}
        backend = self.backend
        if backend == "nccl":
            torch.cuda.set_device(self.device())
            kwargs["device_id"] = self.device()
            backend = "cpu:gloo,cuda:nccl"  # CPU tensors in the same tests still work
        dist.init_process_group(
            backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self._group_timeout_s),
            **kwargs,
        )
        self._group = dist.group.WORLD

    def has_default_group(self) -> bool:
        return dist.is_initialized()

    def set_own_group_aside(self) -> None:
        """No harness group for the next test: destroy the session's own group if it is the
        default one; a group the test's fixtures set up is theirs and stays."""
        if self.has_group() or not dist.is_initialized():
            self.drop_group()

    def drop_group(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        else:  # a test's init that failed here only: the next group must take the same name
            group_release.forget_failed_init()
        self._group = None

    # ---- outcomes and the end ------------------------------------------------------------

    def note_death(self, text: str, signum: int | None = None, code: int | None = None) -> None:
        """Say, before this process dies of something the harness knows (an injected fault),
        what it was; a SIGTERM it sends itself then ends it, as it would a warm rank."""
        with contextlib.suppress(ValueError):  # called from the body, on the main thread
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(Exception):
            self.put(
                f"died/{self.rank}", json.dumps({"text": text, "signal": signum, "code": code})
            )

    def exchange(self, key: str, outcome: RankOutcome, seconds: float) -> list[RankOutcome]:
        """Every rank's outcome of run `key`; a rank that published none is read as gone."""
        mine = None if key in self._hung else records.encode_outcome(outcome)  # or the timer's
        found = self.gather(f"{key}/outcome", mine, seconds)
        own = self._hung.get(key, outcome)  # what this rank said, where its word cannot arrive
        return [
            self._outcome(key, r, blob)
            if blob is not None
            else (own if r == self.rank and self.store_lost else self._missing(key, r, found))
            for r, blob in enumerate(found.values)
        ]

    @property
    def store_lost(self) -> str:
        """Why the launch's store stopped answering ("" while it answers)."""
        return "" if self._peers is None else self._peers.lost

    def _outcome(self, key: str, rank: int, blob: bytes) -> RankOutcome:
        """Rank `rank`'s outcome as read from the store: data, checked, never code. A value
        that is not the harness's record fails the test naming the key, and is ignored."""
        try:
            return records.decode_outcome(blob, key, rank)
        except records.RecordError as exc:
            store_key = f"{key}/outcome/{rank}"
            return RankOutcome(
                key,
                rank,
                0,
                Ending.RAISED,
                at=time.monotonic(),
                exc_type="harness.RecordError",
                message=(
                    f"harness error: the value under {store_key!r} in the launch's store is not "
                    f"an outcome the harness wrote ({exc}); it was ignored, nothing in it was "
                    f"run. Something else writes to this job's store: use a run id no one can "
                    f"guess and a secret (see docs/clusters.md)"
                ),
            )

    def hang_reports(self, key: str, ranks: list[int]) -> str:
        """What the timers of `ranks` recorded under `key` (a hang, with its stacks) before
        their process ended; empty if none did. Each record is checked as any outcome."""
        texts = []
        for rank in ranks:
            blob = self._store.read(f"{key}/outcome/{rank}")
            if blob is not None:
                texts.append(failure_text([self._outcome(key, rank, blob)]))
        return "".join(f"\n{text}" for text in texts if text)

    def _missing(self, key: str, rank: int, found: Gathered) -> RankOutcome:
        died = self._died(rank)
        why = f"it died: {died['text']}" if died else found.why(rank)
        pid = records.read_int(self._store.read(f"pid/{rank}"), f"pid/{rank}", 0)
        node_lost = "" if died else self._node_lost(rank, found)
        if node_lost:  # first in time: when its node went, not when this rank noticed
            self.fate.lose({rank: node_lost})
            went = self._store.lost_at if self._store.lost else self._store.last_sign_of_life(rank)
            unheard = self._store.lost and self.nodes.node_of(rank) != self.nodes.store_node
            origin = self.nodes.store_rank() if unheard else None  # alive, most likely
            return RankOutcome(
                key, rank, pid, Ending.LOST, message=node_lost, at=went, origin_rank=origin
            )
        self.fate.lose({rank: why})
        note = f"rank {rank} gave no outcome: {why}"
        signum = died.get("signal")
        code = None if signum is not None else died.get("code")
        return outcome_from_exitcode(key, rank, pid, code, time.monotonic(), signum).noted(note)

    def _node_lost(self, rank: int, found: Gathered) -> str:
        """What happened to `rank`'s node, where it is gone or out of reach as a whole ("":
        it is not, or which node `rank` runs on is unknown): every rank of the node absent,
        or the launch's store gone (its node lost, or this one cut off from it)."""
        node, store_node = self.nodes.node_of(rank), self.nodes.store_node
        if self._store.lost:
            store = store_node or "the node that held it"
            if node == store_node or not store_node:
                said = self._store.lost
                return f"{store} was lost: the launch's store there stopped answering ({said})"
            return f"not heard from: the launch's store was lost with {store}"
        if not node:
            return ""
        here = self.nodes.ranks_on(node)
        if any(r == self.rank or (r not in found.absent and r not in self.fate.lost) for r in here):
            return ""  # one rank of it went: its node is still there
        return (
            f"{node} was lost: none of its ranks gave an outcome or a sign of life (the node "
            f"went down, its processes were killed, or its link was cut)"
        )

    def say_place(self) -> None:
        self._store.say_place()

    def watch_crashes(self) -> None:
        """From here a fatal signal on this node is named at once (see crashes.py): this
        rank's crash report goes to its file, and its heartbeat looks at the ranks beside it
        (same node, same machine and pid namespace)."""
        node = self.nodes.node_of(self.rank)
        beside = {r: self._store.pid_here(r) for r in self.nodes.ranks_on(node) if r != self.rank}
        crashes = Crashes(self._store.prefix, self.rank, {r: p for r, p in beside.items() if p})
        crashes.watch_own()
        self.crashes = crashes

    def look_for_crashes(self) -> None:
        """A heartbeat's look at the ranks beside this one (see crashes.py)."""
        if self.crashes is not None and not self.fate.finished.is_set():
            self.crashes.look(lambda r, said: self.put(f"died/{r}", said), self.say)

    def placed(self, nodes: Nodes) -> None:
        """The ranks said which node each runs on (see agreements.py)."""
        self.nodes = nodes

    def _died(self, rank: int) -> dict[str, Any]:
        """What rank `rank` said as it died ({} if nothing, or nothing of the harness's)."""
        blob = self._store.read(f"died/{rank}")
        if blob is None:
            return {}
        fields: dict[str, Any] = {
            "text": str,
            "signal": (int, type(None)),
            "code": (int, type(None)),
        }
        try:
            return records.read_json(blob, f"died/{rank}", fields)
        except records.RecordError:
            return {}

    def publish_hang(self, key: str, outcome: RankOutcome) -> None:
        """This rank's timer found it hung in run `key`: publish that as its outcome (the main
        thread, if it comes back, keeps it)."""
        self._hung[key] = outcome
        self.put(f"{key}/outcome/{self.rank}", records.encode_outcome(outcome))

    def launcher_stopped(self) -> bool:
        """The launcher is stopping the job: waits end soon, and the main thread stops after
        this test. False when that is known already (or the session never connected)."""
        if self.stopping or self._peers is None:
            return False
        self._peers.stopping = True
        with contextlib.suppress(Exception):
            self.put(f"stopped/{self.rank}", self.current or "-")
        return True

    def own_outcome(self, key: str) -> RankOutcome:
        """The outcome this rank published for run `key` (its timer's, for a hang)."""
        if key in self._hung:
            return self._hung[key]
        blob = self._store.read(f"{key}/outcome/{self.rank}") or b""
        return records.decode_outcome(blob, key, self.rank)

    def reports(self) -> bool:
        """Whether this rank prints the session's reports: rank 0, or the rank that speaks
        for a lost one (see speak_for_rank_0): the lowest with no live rank below it."""
        if self.real_writer is None:
            return True
        if not self.store_lost and self._peers is not None:
            if self._peers.live_below(self.rank, QUIET_AFTER_S):
                return False
            for rank in range(self.rank):
                self.fate.lose_unless_known(rank, "no sign of life")
        self.speak_for_rank_0()
        return self.real_writer is None

    def stop_report(self, wait_s: float) -> str:
        """Rank 0's words on a job the launcher stopped: which ranks ended first (they said
        nothing within `wait_s` of being stopped), with what they said as they died."""
        others = [r for r in range(self.world_size) if r != self.rank]
        self.wait([f"stopped/{r}" for r in others], wait_s)
        if self._store.lost:  # no rank's word arrives: say what is known, the lost node
            none = Gathered([None] * self.world_size)
            outcomes = [self._missing(self.test_key(), r, none) for r in others]
            text = failure_text(outcomes) or f"the launch's store is gone ({self._store.lost})"
            head = text.splitlines()[0]
            during = f"during {self.current}" if self.current else "between tests"
            verdict = f"FAILED {self.current} - {head}\n" if self.current else ""
            return f"{verdict}harness: the launcher stopped the job {during}: {text}"
        gone = {
            r: self._died(r).get("text", "") for r in others if not self._store.has(f"stopped/{r}")
        }
        return terminal.stop_report(self.current, self.world_size, gone, dict(self.nodes.said))

    def say(self, text: str) -> None:
        """Write to the real terminal, past pytest's capture, whichever rank this is."""
        terminal.loud(self.config, text)

    def end_early(self, text: str) -> None:
        """The reporting rank could not finish the session: the others read status 1 as its
        last word, and torchrun's summary shows `text` (its report) as this rank's error."""
        self.put("final", "1")
        stamp = int(time.time())
        write_launcher_error(f"{self.current}: {headline(text)}"[:2000], text, stamp)

    def last_words(self, nodeid: str, text: str, hung_at: float) -> None:
        """This rank ends before the session's end (its timer found it hung at `hung_at`, by
        the clock): its node's terminal and torchrun's error file say the verdict it knows
        (`text`, a report), its own failure if the report blames this rank (stamped before
        any peer could have heard of it), else as collateral of the rank it blames."""
        line = headline(text)
        own = blamed_rank(line) in (None, self.rank)
        said = f"{nodeid}: {line}" if own else f"collateral: {nodeid}: {line}"
        stamp = int(hung_at) - 1 if own else int(time.time()) + 1
        write_launcher_error(said[:2000], text if own else said, stamp)
        with contextlib.suppress(Exception):  # the others' wait for every entry (error_files.py)
            self.put(f"error-file/{self.rank}", "1")
        self.tell_node(nodeid, text)

    def summary(self, reporter: Any) -> None:
        """Rank 0's last words on the terminal (a quiet rank says nothing)."""
        if self.real_writer is not None:
            return
        peers = self._peers
        terminal.summary(
            reporter,
            unsigned=peers is not None and peers.secret is None,
            refused=[] if peers is None else list(peers.refused),
            peer_collection_errors=self.fate.peer_collection_errors,
            stop_reason=self.fate.stop_reason,
            not_run=self.position.not_run(),
        )

    def speak_for_rank_0(self) -> None:
        """Rank 0 is gone: the lowest rank left prints the report from here on; with the
        launch's store gone, the lowest of each node's ranks (no rank hears another now)."""
        alive = [r for r in range(self.world_size) if r not in self.fate.lost]
        if self.store_lost:
            node = self.nodes.node_of(self.rank)
            alive = self.nodes.ranks_on(node) if node else [self.rank]
        if self.real_writer is None or not alive or alive[0] != self.rank:
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter._tw = self.real_writer
        self.real_writer = None
        if self.store_lost:
            why = f"the launch's store stopped answering ({self.store_lost}); no rank hears another"
            terminal.loud(self.config, f"harness: {why}: rank {self.rank} reports for its node")
            return
        why = self.fate.lost.get(0, "no sign of life")
        terminal.loud(self.config, f"harness: rank 0 is gone ({why}); rank {self.rank} reports")

    def tell_node(self, nodeid: str, text: str) -> None:
        """Where a node was lost, each node's lowest rank that does not report the test says
        its verdict in one line on its own node's terminal: every surviving node shows it."""
        if self.real_writer is None or not self.nodes.leads_node(self.rank) or not text:
            return
        node = self.nodes.node_of(self.rank)
        terminal.loud(
            self.config,
            f"FAILED {nodeid} - {text.splitlines()[0]} (rank {self.rank} for {node}; the "
            f"whole report is the reporting rank's)",
        )

    def stop(self, reason: str, session: pytest.Session) -> None:
        """End the session after the current test: a rank cannot go on."""
        self.fate.stop(reason, session)

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


def cuda_index(launch: Launch) -> int:
    """This rank's GPU: LOCAL_RANK, or the one GPU a launcher made visible to each process."""
    count = torch.cuda.device_count()
    return launch.local_rank if count > launch.local_rank else 0
