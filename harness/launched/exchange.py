"""The outcome exchange of a launched session: after each run every rank publishes its outcome
and reads every other rank's, so that every rank reaches the same verdict. A rank that
published none is read as what became of it: dead (as it said), its node lost (every rank of
it silent, or the store there gone), or gone for the reason its absence gives. Every value is
a checked record (records.py), never code.

Built when the session connects (session.py); imports torch through link.py.
"""

from __future__ import annotations

import time
from typing import Any

from harness.common.outcome import Ending, RankOutcome
from harness.common.report_text import failure_text
from harness.launched import records
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.link import Link
from harness.launched.nodes import Nodes


class OutcomeExchange:
    """Every rank's outcome of a run, as this rank reads them."""

    def __init__(self, link: Link, rank: int, fate: Fate, nodes: Nodes) -> None:
        self._link = link
        self._store = link.peers
        self._rank = rank
        self._fate = fate
        self._nodes = nodes
        self._hung: dict[str, RankOutcome] = {}  # the outcomes this rank's timer published

    def placed(self, nodes: Nodes) -> None:
        """The ranks said which node each runs on (see agreements.py)."""
        self._nodes = nodes

    def exchange(
        self, key: str, outcome: RankOutcome, seconds: float, finishing: bool = False
    ) -> list[RankOutcome]:
        """Every rank's outcome of run `key`; a rank that published none is read as gone.
        `finishing`: this rank is past its test's body as it publishes (Link.gather)."""
        mine = None if key in self._hung else records.encode_outcome(outcome)  # or the timer's
        found = self._link.gather(f"{key}/outcome", mine, seconds, finishing=finishing)
        own = self._hung.get(key, outcome)  # what this rank said, where its word cannot arrive
        return [
            self._outcome(key, r, blob)
            if blob is not None
            else (own if r == self._rank and self._store.lost else self.missing(key, r, found))
            for r, blob in enumerate(found.values)
        ]

    def publish_hang(self, key: str, outcome: RankOutcome) -> None:
        """This rank's timer found it hung in run `key`: publish that as its outcome (the main
        thread, if it comes back, keeps it)."""
        self._hung[key] = outcome
        self._link.put(f"{key}/outcome/{self._rank}", records.encode_outcome(outcome))

    def own_outcome(self, key: str) -> RankOutcome:
        """The outcome this rank published for run `key` (its timer's, for a hang)."""
        if key in self._hung:
            return self._hung[key]
        blob = self._store.read(f"{key}/outcome/{self._rank}") or b""
        return records.decode_outcome(blob, key, self._rank)

    def hang_reports(self, key: str, ranks: list[int]) -> str:
        """What the timers of `ranks` recorded under `key` (a hang, with its stacks) before
        their process ended; empty if none did. Each record is checked as any outcome."""
        texts = []
        for rank in ranks:
            blob = self._store.read(f"{key}/outcome/{rank}")
            if blob is not None:
                texts.append(failure_text([self._outcome(key, rank, blob)]))
        return "".join(f"\n{text}" for text in texts if text)

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

    def missing(self, key: str, rank: int, found: Gathered) -> RankOutcome:
        """Rank `rank`'s outcome of run `key`, which it did not publish: what it said as it
        died, its node lost, or its absence's reason (the rank counts as lost from here)."""
        died = self.died(rank)
        why = f"it died: {died['text']}" if died else found.why(rank)
        pid = records.read_int(self._store.read(f"pid/{rank}"), f"pid/{rank}", 0)
        node_lost = "" if died else self._node_lost(rank, found)
        if node_lost:  # first in time: when its node went, not when this rank noticed
            self._fate.lose({rank: node_lost})
            store = self._store
            went = store.lost_at if store.lost else store.last_sign_of_life(rank)
            unheard = store.lost and self._nodes.node_of(rank) != self._nodes.store_node
            origin = self._nodes.store_rank() if unheard else None  # alive, most likely
            return RankOutcome(
                key, rank, pid, Ending.LOST, message=node_lost, at=went, origin_rank=origin
            )
        self._fate.lose({rank: why})
        note = f"rank {rank} gave no outcome: {why}"
        now, signum = time.monotonic(), died.get("signal")
        if signum is not None:
            return RankOutcome(key, rank, pid, Ending.SIGNALLED, at=now, signal=signum).noted(note)
        code = died.get("code")  # as the rank said it: a negative one too is a status
        return RankOutcome(key, rank, pid, Ending.HARD_EXIT, at=now, exit_code=code).noted(note)

    def _node_lost(self, rank: int, found: Gathered) -> str:
        """What happened to `rank`'s node, where it is gone or out of reach as a whole ("":
        it is not, or which node `rank` runs on is unknown): every rank of the node absent,
        or the launch's store gone (its node lost, or this one cut off from it)."""
        node, store_node = self._nodes.node_of(rank), self._nodes.store_node
        if self._store.lost:
            store = store_node or "the node that held it"
            if node == store_node or not store_node:
                said = self._store.lost
                return f"{store} was lost: the launch's store there stopped answering ({said})"
            return f"not heard from: the launch's store was lost with {store}"
        if not node:
            return ""
        here = self._nodes.ranks_on(node)
        lost = self._fate.lost
        if any(r == self._rank or (r not in found.absent and r not in lost) for r in here):
            return ""  # one rank of it went: its node is still there
        return (
            f"{node} was lost: none of its ranks gave an outcome or a sign of life (the node "
            f"went down, its processes were killed, or its link was cut)"
        )

    def died(self, rank: int) -> dict[str, Any]:
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
