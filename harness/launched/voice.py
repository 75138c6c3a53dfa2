"""Which launched rank speaks, and where. Rank 0 prints the session's reports; the others are
quiet, each keeping its real terminal writer to speak with: the lowest rank left speaks for
a lost rank 0 (for its own node once the launch's store is gone, when no rank hears
another), each node's lowest rank says a verdict in one line on its node's terminal, and a
rank that ends before the session does leaves its words in torchrun's error file.

A part of the launched session (session.py builds it); the parts it reads (what became of
the ranks, which node each runs on, the store) are passed to each call.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
from rankwise.testing import write_launcher_error

from harness.launched import terminal
from harness.launched.blame import blamed_rank, headline
from harness.launched.fate import Fate
from harness.launched.link import Link
from harness.launched.nodes import Nodes
from harness.launched.store import QUIET_AFTER_S, Peers


class Voice:
    """This rank's voice: quiet (its terminal writer kept) or the one that reports."""

    def __init__(self, config: pytest.Config, rank: int, quiet_writer: Any = None) -> None:
        self._config = config
        self._rank = rank
        self.real_writer: Any = quiet_writer  # a quiet rank's terminal writer, to speak with

    @property
    def quiet(self) -> bool:
        """Whether another rank prints the session's reports."""
        return self.real_writer is not None

    def say(self, text: str) -> None:
        """Write to the real terminal, past pytest's capture, whichever rank this is."""
        terminal.loud(self._config, text)

    def reports(self, fate: Fate, nodes: Nodes, peers: Peers | None) -> bool:
        """Whether this rank prints the session's reports: rank 0, or the rank that speaks
        for a lost one (see speak_for_rank_0): the lowest with no live rank below it."""
        if not self.quiet:
            return True
        lost = "" if peers is None else peers.lost
        if not lost and peers is not None:
            if peers.live_below(self._rank, QUIET_AFTER_S):
                return False
            for rank in range(self._rank):
                fate.lose_unless_known(rank, "no sign of life")
        self.speak_for_rank_0(fate, nodes, lost)
        return not self.quiet

    def speak_for_rank_0(self, fate: Fate, nodes: Nodes, store_lost: str) -> None:
        """Rank 0 is gone: the lowest rank left prints the report from here on; with the
        launch's store gone (`store_lost` says why), the lowest of each node's ranks."""
        alive = [r for r in range(nodes.launch.world_size) if r not in fate.lost]
        if store_lost:
            node = nodes.node_of(self._rank)
            alive = nodes.ranks_on(node) if node else [self._rank]
        if not self.quiet or not alive or alive[0] != self._rank:
            return
        reporter = self._config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter._tw = self.real_writer
        self.real_writer = None
        if store_lost:
            why = f"the launch's store stopped answering ({store_lost}); no rank hears another"
            self.say(f"harness: {why}: rank {self._rank} reports for its node")
            return
        why = fate.lost.get(0, "no sign of life")
        self.say(f"harness: rank 0 is gone ({why}); rank {self._rank} reports")

    def tell_node(self, nodes: Nodes, nodeid: str, text: str) -> None:
        """Where a node was lost, each node's lowest rank that does not report the test says
        its verdict in one line on its own node's terminal: every surviving node shows it."""
        if not self.quiet or not nodes.leads_node(self._rank) or not text:
            return
        self.say(
            f"FAILED {nodeid} - {text.splitlines()[0]} (rank {self._rank} for "
            f"{nodes.node_of(self._rank)}; the whole report is the reporting rank's)"
        )

    def summary(self, reporter: Any, fate: Fate, peers: Peers | None, not_run: list[str]) -> None:
        """Rank 0's last words on the terminal (a quiet rank says nothing)."""
        if self.quiet:
            return
        terminal.summary(
            reporter,
            unsigned=peers is not None and peers.secret is None,
            refused=[] if peers is None else list(peers.refused),
            peer_collection_errors=fate.peer_collection_errors,
            stop_reason=fate.stop_reason,
            not_run=not_run,
        )

    def end_early(self, link: Link, nodeid: str | None, text: str) -> None:
        """The reporting rank could not finish the session: the others read status 1 as its
        last word, and torchrun's summary shows `text` (its report) as this rank's error."""
        link.put("final", "1")
        write_launcher_error(f"{nodeid}: {headline(text)}"[:2000], text, int(time.time()))

    def last_words(self, link: Link, nodes: Nodes, nodeid: str, text: str, hung_at: float) -> None:
        """This rank ends before the session's end (its timer found it hung at `hung_at`, by
        the clock): its node's terminal and torchrun's error file say the verdict it knows
        (`text`, a report), its own failure if the report blames this rank (stamped before
        any peer could have heard of it), else as collateral of the rank it blames."""
        line = headline(text)
        own = blamed_rank(line) in (None, self._rank)
        said = f"{nodeid}: {line}" if own else f"collateral: {nodeid}: {line}"
        stamp = int(hung_at) - 1 if own else int(time.time()) + 1
        write_launcher_error(said[:2000], text if own else said, stamp)
        with contextlib.suppress(Exception):  # the others' wait for every entry (error_files.py)
            link.put(f"error-file/{self._rank}", "1")
        self.tell_node(nodes, nodeid, text)
