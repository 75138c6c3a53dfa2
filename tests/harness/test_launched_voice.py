"""Which launched rank speaks, tested directly with fakes (no launch, no process): a quiet
rank speaks for rank 0 only once no rank below it shows a sign of life, each node's lowest
rank reports for its node once the store is gone, and only a quiet node's leader says a
verdict in a line on its node's terminal."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness.common.launch_detect import Launch
from harness.launched.fate import Fate
from harness.launched.nodes import Nodes
from harness.launched.voice import Voice

pytestmark = pytest.mark.unit


class FakePeers:
    def __init__(self, live_below: bool, lost: str = "") -> None:
        self.live, self.lost = live_below, lost

    def live_below(self, rank: int, within_s: float) -> bool:
        return self.live


def _voice(rank: int) -> tuple[Voice, Any, Nodes]:
    reporter = SimpleNamespace(_tw=None)
    plugins = SimpleNamespace(getplugin=lambda name: None, get_plugin=lambda name: reporter)
    config: Any = SimpleNamespace(pluginmanager=plugins)
    launch = Launch(4, rank, rank % 2, 2, "127.0.0.1", 29500, True, "run/0", node=rank // 2)
    return Voice(config, rank, quiet_writer="rank's own terminal"), reporter, Nodes(launch)


def test_a_quiet_rank_stays_quiet_while_a_rank_below_it_lives() -> None:
    voice, reporter, nodes = _voice(rank=1)
    assert not voice.reports(Fate(), nodes, FakePeers(live_below=True))  # type: ignore[arg-type]
    assert voice.quiet and reporter._tw is None


def test_the_lowest_rank_left_speaks_for_a_silent_rank_0(capfd: pytest.CaptureFixture[str]) -> None:
    voice, reporter, nodes = _voice(rank=1)
    fate = Fate()
    assert voice.reports(fate, nodes, FakePeers(live_below=False))  # type: ignore[arg-type]
    assert not voice.quiet and reporter._tw == "rank's own terminal"  # pytest's report is its
    assert fate.lost == {0: "no sign of life"}
    assert "harness: rank 0 is gone (no sign of life); rank 1 reports" in capfd.readouterr().err


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_with_the_store_lost_each_nodes_lowest_rank_reports_for_its_node(
    rank: int, capfd: pytest.CaptureFixture[str]
) -> None:
    voice, _, nodes = _voice(rank)
    voice.speak_for_rank_0(Fate(), nodes, store_lost="Connection reset")
    assert voice.quiet is (rank % 2 == 1)  # ranks 0 and 2 lead nodes 0 and 1
    said = capfd.readouterr().err
    assert ("reports for its node" in said) is (rank % 2 == 0)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_only_a_quiet_nodes_leader_says_the_verdict_on_its_node(
    rank: int, capfd: pytest.CaptureFixture[str]
) -> None:
    voice, _, nodes = _voice(rank)
    voice.tell_node(nodes, "t.py::test_x", "rank 3 failed: died of SIGSEGV\nmore")
    said = capfd.readouterr().err
    expected = "FAILED t.py::test_x - rank 3 failed: died of SIGSEGV (rank 2 for node 1;"
    assert (expected in said) is (rank == 2), said
