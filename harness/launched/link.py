"""This rank's line to the launch's store, as the session uses it: every key this rank writes
for a test is remembered and deleted once every rank has moved past that test, and every
gather follows a peer that ended its session early (pytest.exit, Ctrl-C) by ending this one
alike. Waits are the store's own (store.py: each bounded, a silent peer named).

Built when the session connects (session.py); imports torch through store.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from harness.launched import records, terminal
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.position import Position
from harness.launched.store import Peers


class Link:
    """Puts, gets and gathers through the launch's store for this rank."""

    def __init__(
        self, peers: Peers, rank: int, position: Position, fate: Fate, config: pytest.Config
    ) -> None:
        self.peers = peers
        self._rank = rank
        self._position = position
        self._fate = fate
        self._config = config
        self._written: dict[int, list[str]] = {}  # this rank's keys, by test index

    def put(self, key: str, value: bytes | str) -> None:
        self._track(key)
        self.peers.put(key, value)

    def _track(self, key: str) -> None:
        """Remember a test's own keys ("t<index>/..."), to delete them once all have read."""
        if key.startswith("t"):
            self._written.setdefault(self._position.index, []).append(key)

    # ---- where this rank is --------------------------------------------------------------

    def begin(self, nodeid: str) -> None:
        """A test starts here (whether it will run, skip or fail): say so to the others."""
        self.reach(self._position.begin(nodeid))

    def reach(self, stage: int) -> None:
        """Say where this rank is, so a peer waiting on it elsewhere stops waiting."""
        self.put(*self._place(stage))

    def _place(self, stage: int) -> tuple[str, str]:
        """This rank is at `stage` now: the key and value that say so to the others."""
        self._position.reach(stage)
        return f"at/{self._rank}", str(stage)

    def finishing(self) -> None:
        """This rank is past the current test's body and calls: only its verdict is left."""
        self.reach(self._position.finishing())

    def own_group_prefix(self) -> str:
        """The store prefix of the next group the current test sets up from torchrun's
        environment (see rendezvous.py): the test and how many came before."""
        return f"{self.peers.prefix}/{self._position.own_group_key()}"

    # ---- puts, gets and gathers --------------------------------------------------------

    def wait(self, keys: Sequence[str], seconds: float) -> bool:
        """Whether every key is set within `seconds` (a few once the job is stopping)."""
        return all(self.get(key, seconds) is not None for key in keys)

    def get(self, key: str, seconds: float) -> bytes | None:
        """The value rank 0 (or any one rank) published at `key`, waiting up to `seconds`."""
        return self.peers.wait_for(key, seconds)

    def gather(
        self,
        name: str,
        value: bytes | str | None,
        seconds: float,
        follow_exits: bool = True,
        finishing: bool = False,
    ) -> Gathered:
        """Every rank's `value` under `name`, in rank order; None for a rank that did not
        publish (gone, moved on, or late past `seconds`), with its reason.

        A rank absent because it ended its session with pytest.exit() or KeyboardInterrupt
        ends this one alike (pytest.exit with its words and status), unless `follow_exits`
        is False (the session's end, where every rank is already stopping). `finishing`:
        this rank says it is past the test's body (see finishing) in the same operation as
        it publishes `value`, its place first.
        """
        if value is not None:
            self._track(f"{name}/{self._rank}")
        first = [self._place(self._position.finishing())] if finishing else []
        found = self.peers.gather(name, value, seconds, set(self._fate.lost), first)
        if found.complete:  # every rank is at this test: all have read the earlier tests' keys
            for old in [i for i in self._written if i < self._position.index]:
                self.peers.drop(self._written.pop(old))
        if follow_exits:
            self._follow_an_exit(found)
        return found

    def _follow_an_exit(self, found: Gathered) -> None:
        for rank in sorted(found.absent):
            blob = self.peers.read(f"exit/{rank}")
            if blob is not None and rank != self._rank:
                key = f"exit/{rank}"
                try:
                    said = records.read_json(blob, key, {"text": str, "code": int})
                except records.RecordError as exc:
                    terminal.loud(self._config, f"harness: ignored {exc} (not this harness's)")
                    continue
                raise pytest.exit(f"[rank {rank}] {said['text']}", returncode=said["code"])
