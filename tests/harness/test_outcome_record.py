"""The outcome record, its diagnosis and its words, each tested directly: a record built
once and changed only through typed methods, frozen all the way down, the same after the
channels it crosses (pickle between warm ranks and pytest, JSON through a launch's store)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from harness.common import diagnosis, endings, report_text, root_cause
from harness.common.outcome import Ending, Findings, RankOutcome, RankWarning
from harness.launched import records
from tests.harness.conftest import outcome

pytestmark = pytest.mark.unit

GLOO_GONE = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:20155. This is typically caused by a remote worker crashing."
)
C10D_TRACEBACK = (
    'Traceback (most recent call last):\n  File "/x/torch/distributed/distributed_c10d.py", '
    "line 5356, in barrier\n    work.wait()\nRuntimeError: " + GLOO_GONE
)


def test_the_record_has_no_untyped_change() -> None:
    """Every change is a typed method that says what it is for: no `but(**changes)`."""
    assert not hasattr(RankOutcome, "but")


def test_leftovers_are_read_only_whatever_the_record_was_given() -> None:
    o = outcome(0, leftovers={"threads": "left thread 'x' running"})
    assert isinstance(o.leftovers, Findings)
    with pytest.raises(TypeError):
        o.leftovers["env"] = "set FOO"  # type: ignore[index]
    more = o.with_leftover("threads", "and 'y'")
    assert more.leftovers == {"threads": "left thread 'x' running; and 'y'"}
    assert o.leftovers == {"threads": "left thread 'x' running"}  # the first record unchanged


@pytest.mark.parametrize("leftovers", [{}, {"group": "left its group", "env": "set A=1"}])
def test_a_record_crosses_pickle_and_json_unchanged(leftovers: dict[str, str]) -> None:
    o = outcome(
        2,
        Ending.RAISED,
        exc_type="builtins.ValueError",
        message="bad",
        leftovers=leftovers,
        warnings=(RankWarning("builtins.UserWarning", "w", "f.py", 3),),
        notes=("a note",),
    )
    assert pickle.loads(pickle.dumps(o)) == o
    through_store = records.decode_outcome(records.encode_outcome(o), o.key, o.rank)
    assert dataclasses.replace(through_store, pid=o.pid, at=o.at) == o
    said = json.loads(records.encode_outcome(o))["fields"]
    assert said.get("leftovers", {}) == leftovers and ("leftovers" in said) == bool(leftovers)


def test_typed_changes_touch_only_their_fields() -> None:
    o = outcome(1, Ending.HUNG, stack="s", notes=("n",))
    assert o.with_output("out", "err").output == "outerr"
    assert o.with_output("out", "err").log == "" and o.with_output("o", "e", "l").log == "l"
    assert o.replaced("left a mode").replace_after == "left a mode"
    assert o.with_stack("folded").stack == "folded"
    assert o.with_traceback("tb").traceback == "tb"
    tried = o.set_up_tried(3, failed=True)
    assert (tried.setup_attempts, tried.setup_failed) == (3, True)
    assert o.set_up_tried(2).setup_failed is False
    found = o.with_findings((RankWarning("c", "m", "f", 1),), {"env": "set B"})
    assert found.warnings[0].message == "m" and found.leftovers == {"env": "set B"}
    skipped = o.skipped_instead("Need at least 2 CUDA devices")
    assert (skipped.ending, skipped.message, skipped.notes) == (
        Ending.SKIPPED,
        skipped.message,
        ("n",),
    )
    mismatch = o.raised_instead("harness.X", ("X", "Exception"), "ranks disagree", at=1.5)
    assert (mismatch.ending, mismatch.exc_classes, mismatch.at) == (
        Ending.RAISED,
        ("harness.X",),
        1.5,
    )
    assert mismatch.origin_rank is None and mismatch.notes == ("n",)


def test_a_rank_builds_its_ending_once_from_what_the_exception_says() -> None:
    class Stop(Exception):
        origin_rank = 3

    try:
        raise Stop("peer 3 failed")
    except Stop as exc:
        got = endings.ended_by("t0", 1, exc)
    assert (got.ending, got.origin_rank, got.exc_name) == (Ending.RAISED, 3, "Stop")
    assert got.looks_collateral  # another rank's failure, by its own word
    try:
        raise SystemExit("goodbye")
    except SystemExit as exc:
        left = endings.ended_by("t0", 1, exc)
    assert (left.ending, left.exit_code, left.message) == (Ending.EXITED, 1, "goodbye")
    assert endings.not_reached("t0", 0, ValueError("never")).exc_mro == ("ValueError",)
    kept = endings.returned("t0", 0, lambda: None)  # a value that does not pickle
    assert kept.value_lost and kept.notes[0].startswith("the return value could not be sent")


def test_diagnosis_reads_torchs_words_not_the_ranks_own() -> None:
    assert diagnosis.reads_as_peer_gone(
        "RuntimeError", ("builtins.RuntimeError",), GLOO_GONE, C10D_TRACEBACK
    )
    own_socket = 'File "/app/client.py", line 3, in send'
    assert not diagnosis.reads_as_peer_gone(
        "ConnectionRefusedError", (), "Connection refused", own_socket
    )
    assert diagnosis.reads_as_peer_gone("DistNetworkError", (), "anything", "")
    assert not diagnosis.reads_as_peer_gone("DistNetworkError", (), "EADDRINUSE", "")
    assert diagnosis.innermost_collective(C10D_TRACEBACK) == "barrier"
    hung = 'File "/x/torch/distributed/distributed_c10d.py", line 2 in all_reduce'  # faulthandler's
    assert diagnosis.collective_in_stack(hung) == "all_reduce"
    assert diagnosis.waiting_in_torch(hung) and not diagnosis.waiting_in_torch("File x.py")
    assert diagnosis.report_looks_collateral("torch/distributed/ ... " + GLOO_GONE)


def test_the_root_cause_is_the_first_failure_no_peer_caused() -> None:
    first = outcome(1, Ending.RAISED, exc_type="builtins.AssertionError", message="no", at=2.0)
    peer = outcome(
        0, Ending.RAISED, exc_type="builtins.RuntimeError", message=GLOO_GONE,
        traceback=C10D_TRACEBACK, at=1.0,
    )  # fmt: skip
    outcomes = [peer, first, outcome(2)]
    found = root_cause.diagnose(outcomes, root_cause.failed_ranks(outcomes))
    assert (found.root, found.collateral) == (1, (0,))
    assert root_cause.root_cause(outcomes) == first
    text = report_text.failure_text(outcomes, style=report_text.ReportStyle(verbose=False))
    assert text is not None
    assert text.splitlines()[0] == "rank 1 failed: raised AssertionError: no; rank 0 collateral"
    assert "rank 0 (pid 100), waiting in barrier: its collective failed as a peer went away" in text
