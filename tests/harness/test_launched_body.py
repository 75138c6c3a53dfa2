"""A launched test's set-up agreement and the session's course after a run, tested directly
with fakes for the session's parts (no launch, no process): the body starts only where every
rank set up; a peer's failed set-up, a skip on some ranks or a silent rank fails the test on
every rank, naming it; a hang or a lost rank ends the session after the test."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness.common.launch_detect import Launch
from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import RankSpec
from harness.launched import body
from harness.launched.fate import Fate
from harness.launched.gathered import Gathered
from harness.launched.nodes import Nodes
from harness.launched.position import Position

pytestmark = pytest.mark.unit

NODEID = "t.py::test_a"


class FakeGroup:
    def __init__(self) -> None:
        self.dropped = 0

    def drop(self) -> None:
        self.dropped += 1


class FakeLink:
    """Every other rank's word at the set-up as the test gives it (None: silent)."""

    def __init__(self, rank: int, theirs: dict[int, str | None], world: int) -> None:
        self.rank, self.theirs, self.world = rank, theirs, world
        self.peers = SimpleNamespace(lost="", stopping=False)

    def gather(self, key: str, mine: str, seconds: float) -> Gathered:
        said = {r: None if t is None else t.encode() for r, t in self.theirs.items()}
        said[self.rank] = mine.encode()
        values = [said.get(r) for r in range(self.world)]
        return Gathered(values, {r: "no sign of life" for r, v in enumerate(values) if v is None})


def _session(theirs: dict[int, str | None], rank: int = 0, world: int = 4) -> Any:
    launch = Launch(world, rank, rank, world, "n1", 29500, True, "run/0")
    return SimpleNamespace(
        rank=rank, world_size=world, backend="gloo", group=FakeGroup(), fate=Fate(),
        link=FakeLink(rank, theirs, world), nodes=Nodes(launch), position=Position(),
        voice=SimpleNamespace(speak_for_rank_0=lambda *a: None, tell_node=lambda *a: None),
    )  # fmt: skip


def _item() -> Any:
    config = SimpleNamespace(pluginmanager=SimpleNamespace(hook=None, get_plugin=lambda _: None))
    item = SimpleNamespace(nodeid=NODEID, config=config, session=SimpleNamespace(), stash={})
    item.stash[body._key_key] = "t0"
    return item


def _agree(session: Any, error: BaseException | None = None) -> Any:
    item = _item()
    body.agree_on_set_up(
        item, session, RankSpec(world_size=session.world_size, timeout_s=60.0), error
    )
    return item


def test_the_body_starts_where_every_rank_set_up() -> None:
    session = _session({1: "", 2: "", 3: ""})
    _agree(session)
    assert session.group.dropped == 0


def test_a_peers_failed_set_up_fails_the_test_here_naming_it_and_frees_the_group() -> None:
    session = _session({1: "", 2: "OSError: no space left", 3: "RuntimeError: bad"})
    with pytest.raises(pytest.fail.Exception) as info:
        _agree(session)
    assert str(info.value) == (
        "rank 2's set-up failed (OSError: no space left); rank 0 did not run the body: every "
        "rank must set up alike"
    )
    assert session.group.dropped == 1


def test_a_rank_whose_own_set_up_failed_raises_its_own_error_after_freeing_the_group() -> None:
    session = _session({1: "", 2: "", 3: ""}, rank=0)
    _agree(session, OSError("no space left"))  # returns: pytest raises this rank's own error
    assert session.group.dropped == 1


@pytest.mark.parametrize("skipped_here", [False, True], ids=["others skipped", "this rank skipped"])
def test_a_skip_on_some_ranks_only_fails_the_test(skipped_here: bool) -> None:
    theirs: dict[int, str | None] = {1: "skip: no GPU", 2: "", 3: ""}
    session = _session(theirs, rank=0)
    if skipped_here:
        theirs[1] = ""
        error: BaseException | None = pytest.skip.Exception("no GPU")
        _agree(session, error)  # this rank raises its own skip; the others fail, below
        return
    with pytest.raises(pytest.fail.Exception, match=r"rank 1 skipped in set-up \(skip: no GPU\)"):
        _agree(session)


def test_a_skip_on_every_rank_is_every_ranks_skip() -> None:
    session = _session({1: "skip: no GPU", 2: "skip: no GPU", 3: "skip: no GPU"})
    _agree(session, pytest.skip.Exception("no GPU"))
    assert session.group.dropped == 0  # a skip breaks nothing


def test_a_silent_rank_fails_the_test_and_ends_the_session_after_it() -> None:
    session = _session({1: "", 2: None, 3: ""})
    item = _item()
    with pytest.raises(pytest.fail.Exception, match="not every rank finished setting up"):
        body.agree_on_set_up(item, session, RankSpec(world_size=4, timeout_s=60.0), None)
    assert session.fate.lost == {2: "no sign of life"}
    assert item.session.shouldfail.startswith(f"ranks out of step at {NODEID}")


def _outcome(rank: int, ending: Ending, collateral: bool = False) -> RankOutcome:
    notes = ("waited on a peer",) if collateral else ()
    return RankOutcome("t0", rank, 100 + rank, ending, notes=notes)


def test_after_a_clean_run_the_session_goes_on_with_its_group() -> None:
    session = _session({})
    item = _item()
    body._after(item, session, [_outcome(r, Ending.RETURNED) for r in range(4)])
    assert session.group.dropped == 0 and not hasattr(item.session, "shouldfail")


def test_after_a_hang_the_group_goes_and_the_session_ends_after_the_test() -> None:
    session = _session({})
    item = _item()
    outcomes = [_outcome(r, Ending.RETURNED) for r in range(4)]
    outcomes[3] = _outcome(3, Ending.HUNG)
    body._after(item, session, outcomes)
    assert session.group.dropped == 1 and session.fate.lost == {3: "it hung"}
    assert item.session.shouldfail == (
        f"the session ends after {NODEID} (rank 3: it hung): a launched rank cannot be replaced"
    )


def test_a_test_that_needs_another_world_or_gpus_is_skipped_alike_everywhere() -> None:
    session = _session({})
    assert (
        body.skip_reason(session, RankSpec(world_size=4, timeout_s=60.0), gpu_marked=False) is None
    )
    assert body.skip_reason(session, RankSpec(world_size=2, timeout_s=60.0), False) == (
        "needs 2 ranks, launched with 4"
    )
    assert "needs GPUs" in (
        body.skip_reason(session, RankSpec(world_size=4, timeout_s=60.0), True) or ""
    )
