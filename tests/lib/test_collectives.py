"""all_reduce and broadcast_from: values, copies, and every failure combination of the spec.

Failure cases run through `run_on_ranks` with a short timeout and declare every rank's end:
a rank still waiting would come back HUNG, so each also proves nobody was left waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

import pytest
import rankwise as rw
import torch
import torch.distributed as dist
from rankwise import _transport

from harness import Ending

R, E, X = Ending.RETURNED, Ending.RAISED, Ending.EXITED
BOUND_S = 120  # a safety net far above the milliseconds these take: a waiting rank comes back HUNG


class Opaque:
    """Not registered with add_safe_globals: cannot load with weights_only."""


# ---- values ----------------------------------------------------------------------------------


@pytest.mark.ranks(4)
def test_all_reduce_combines_every_ranks_value_in_rank_order(rank: int) -> None:
    assert rw.all_reduce("order", lambda: rank, lambda xs: xs) == [0, 1, 2, 3]
    assert rw.all_reduce("min", lambda: 10 + rank, min) == 10
    maxima = rw.all_reduce(
        "amax", lambda: torch.tensor([rank, 3 - rank]), lambda ts: torch.stack(ts).amax(0)
    )
    assert maxima.tolist() == [3, 3]


_SENT = torch.arange(3.0)


@pytest.mark.ranks(4)
def test_combine_gets_cpu_copies_not_the_objects_sent(rank: int) -> None:
    seen = rw.all_reduce("copies", lambda: {"t": _SENT, "n": [rank]}, lambda xs: xs)
    assert all(x["t"] is not _SENT and x["t"].device.type == "cpu" for x in seen)
    assert [x["n"] for x in seen] == [[0], [1], [2], [3]]
    got = rw.broadcast_from("copy", lambda: _SENT, src=1)
    assert got is not _SENT and torch.equal(got, _SENT)  # src too gets a copy


@pytest.mark.ranks(4)
def test_broadcast_from_runs_fn_on_src_only(rank: int, shared_tmp_path: Any) -> None:
    def read_setting() -> dict[str, Any]:
        (shared_tmp_path / f"ran-on-{rank}").touch()
        return {"lr": 0.1, "from": rank}

    assert rw.broadcast_from("setting", read_setting, src=2) == {"lr": 0.1, "from": 2}
    rw.barrier()
    assert [p.name for p in shared_tmp_path.iterdir()] == ["ran-on-2"]


def test_a_single_process_gets_the_values_as_they_are() -> None:
    value = {"t": _SENT}
    assert rw.all_reduce("one", lambda: value, lambda xs: xs)[0] is value
    assert rw.broadcast_from("one", lambda: value) is value
    opaque = Opaque()  # no wire format in a single process: nothing travels
    assert rw.all_reduce("opaque", lambda: opaque, lambda xs: xs[0]) is opaque


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="label must be a str"):
        rw.all_reduce(3, lambda: 1, sum)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"src=1 is not a rank of this run of 1"):
        rw.broadcast_from("x", lambda: 1, src=1)
    with pytest.raises(TypeError, match="src must be an int"):
        rw.broadcast_from("x", lambda: 1, src="0")  # type: ignore[arg-type]


# ---- all_reduce failures -------------------------------------------------------------------------


def _all_reduce_where(plan: dict[int, str]) -> int:
    """Each rank does what `plan` says in fn: raise, exit, opaque value, other label, or return."""
    me = dist.get_rank()
    action = plan.get(me, "ok")
    label = "other" if action == "label" else "step"

    def fn() -> Any:
        if action.startswith("raise"):
            raise ValueError(f"bad batch on rank {me}")
        if action.startswith("exit"):
            sys.exit(int(action[4:]))
        if action == "opaque":
            return Opaque()
        return me

    return rw.all_reduce(label, fn, sum)


def _run(run_on_ranks: Any, fn: Any, plan: dict[int, str]) -> Any:
    return run_on_ranks(fn, plan, world_size=4, timeout=BOUND_S)


def test_one_rank_raises(run_on_ranks: Any) -> None:
    out = _run(run_on_ranks, _all_reduce_where, {2: "raise"})
    assert out.endings == [E, E, E, E]
    assert (out[2].exc_name, out[2].message) == ("ValueError", "bad batch on rank 2")
    for r in (0, 1, 3):
        assert (out[r].exc_name, out[r].message) == (
            "RuntimeError",
            "all_reduce('step'): rank 2 raised ValueError: bad batch on rank 2",
        )


def test_two_ranks_raise_different_errors(run_on_ranks: Any) -> None:
    out = _run(run_on_ranks, _all_reduce_where, {1: "raise", 3: "raise"})
    assert out.endings == [E, E, E, E]
    assert [out[r].message for r in (1, 3)] == ["bad batch on rank 1", "bad batch on rank 3"]
    assert (
        out[0].message
        == out[2].message
        == ("all_reduce('step'): rank 1 raised ValueError: bad batch on rank 1")
    )


def test_one_rank_exits(run_on_ranks: Any) -> None:
    out = _run(run_on_ranks, _all_reduce_where, {1: "exit3"})
    assert out.endings == [X, X, X, X]
    assert [o.exit_code for o in out] == [3, 3, 3, 3]


def test_two_ranks_exit_with_different_codes(run_on_ranks: Any) -> None:
    out = _run(run_on_ranks, _all_reduce_where, {1: "exit3", 2: "exit5"})
    assert out.endings == [X, X, X, X]
    assert [o.exit_code for o in out] == [3, 3, 5, 3]  # own code, else the first one's


def test_an_error_and_an_exit_together(run_on_ranks: Any) -> None:
    out = _run(run_on_ranks, _all_reduce_where, {1: "exit3", 2: "raise"})
    assert out.endings == [E, E, E, E]
    assert out[2].exc_name == "ValueError"
    for r in (0, 1, 3):
        assert out[r].message == "all_reduce('step'): rank 2 raised ValueError: bad batch on rank 2"


def test_a_value_that_does_not_round_trip_fails_on_its_rank(run_on_ranks: Any) -> None:
    out = _run(run_on_ranks, _all_reduce_where, {0: "opaque"})
    assert out.endings == [E, E, E, E]
    assert out[0].exc_name == "WireError" and "TypeError" in out[0].exc_mro
    assert "torch.serialization.add_safe_globals([YourClass])" in out[0].message
    assert out[3].message.startswith("all_reduce('step'): rank 0 raised WireError:")


def test_labels_out_of_step_raise_on_every_rank_naming_both(run_on_ranks: Any) -> None:
    out = _run(run_on_ranks, _all_reduce_where, {3: "label"})
    assert out.endings == [E, E, E, E]
    for o in out:
        assert o.exc_name == "RuntimeError" and "ranks out of step" in o.message
        assert "rank 0 in all_reduce('step')" in o.message
        assert "rank 3 in all_reduce('other')" in o.message


LONG_LABEL = "layer." * 20_000  # a label built from a model's module names, say


def _long_labels_out_of_step() -> Any:
    tail = "attn" if dist.get_rank() == 0 else "mlp"
    return rw.all_reduce(LONG_LABEL + tail, lambda: 1, sum)


def test_a_long_label_is_shortened_in_messages_keeping_what_tells_ranks_apart(
    run_on_ranks: Any,
) -> None:
    out = run_on_ranks(_long_labels_out_of_step, world_size=2, timeout=BOUND_S)
    assert out.endings == [E, E], out.report()
    for o in out:
        assert "ranks out of step" in o.message and len(o.message) < 1000, o.message[:300]
        assert "layer.attn' (120004 characters, #" in o.message, o.message
        assert "layer.mlp' (120003 characters, #" in o.message, o.message
        assert o.message.startswith("all_reduce('layer.layer."), o.message


def test_long_labels_that_differ_only_in_the_middle_are_told_apart() -> None:
    from rankwise._collectives import _call_of

    one, _ = _call_of("all_reduce", "model." + "block." * 30 + "3.attn" + ".weight" * 10)
    two, _ = _call_of("all_reduce", "model." + "block." * 30 + "4.attn" + ".weight" * 10)
    assert one.text != two.text and len(one.text) < 200, (one.text, two.text)
    quoted, _ = _call_of("all_reduce", "it's " + "e" * 150 + ' say "x"')
    assert quoted.text.startswith("all_reduce('it\\'s eee"), quoted.text  # cut from one repr
    assert quoted.text.split(" (")[0].endswith('say "x"\''), quoted.text
    zeros, _ = _call_of("all_reduce", "\x00" * 120)  # short, but its repr is not
    assert len(zeros.text) < 200, zeros.text


def test_a_long_label_that_is_not_a_str_is_shortened_too() -> None:
    from rankwise._collectives import _call_of

    call, error = _call_of("all_reduce", list(range(10_000)))
    assert error is not None and call.text.startswith("all_reduce([0, 1, 2,")
    assert call.text.endswith("9998, 9999] (a repr of 58890 characters))"), call.text
    assert len(call.text) < 200 and len(str(error)) < 250


def _all_reduce_then_collective_in_a_second_call() -> list[int]:
    """After a failed all_reduce, the same group still works: nobody is left mid-exchange."""
    me = dist.get_rank()
    with contextlib.suppress(ZeroDivisionError, RuntimeError):
        rw.all_reduce("first", lambda: 1 / (me - 1), sum)
    return rw.all_reduce("second", lambda: me, lambda xs: xs)  # type: ignore[no-any-return]


def test_the_group_stays_usable_after_a_failed_call(run_on_ranks: Any) -> None:
    out = run_on_ranks(_all_reduce_then_collective_in_a_second_call, world_size=4, timeout=BOUND_S)
    assert out.values == [[0, 1, 2, 3]] * 4


# ---- broadcast_from failures ---------------------------------------------------------------------


def _broadcast_where(action: str) -> Any:
    me = dist.get_rank()
    label = "other" if action == "label" and me == 3 else "setting"

    def fn() -> Any:
        if action == "raise":
            raise KeyError("no such setting")
        if action == "exit":
            sys.exit(4)
        if action == "opaque":
            return Opaque()
        return {"lr": 0.5}

    return rw.broadcast_from(label, fn, src=1)


def test_src_raising_makes_every_rank_raise(run_on_ranks: Any) -> None:
    out = run_on_ranks(_broadcast_where, "raise", world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E]
    assert out[1].exc_name == "KeyError"
    for r in (0, 2, 3):
        assert (
            out[r].message
            == "broadcast_from('setting'): src rank 1 raised KeyError: 'no such setting'"
        )


def test_src_exiting_makes_every_rank_exit_with_its_code(run_on_ranks: Any) -> None:
    out = run_on_ranks(_broadcast_where, "exit", world_size=4, timeout=BOUND_S)
    assert out.endings == [X, X, X, X] and [o.exit_code for o in out] == [4, 4, 4, 4]


def test_src_value_that_does_not_round_trip(run_on_ranks: Any) -> None:
    out = run_on_ranks(_broadcast_where, "opaque", world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E]
    assert out[1].exc_name == "WireError"
    assert out[0].message.startswith("broadcast_from('setting'): src rank 1 raised WireError")


def test_a_receiver_with_another_label_raises_and_src_returns(run_on_ranks: Any) -> None:
    out = run_on_ranks(_broadcast_where, "label", world_size=4, timeout=BOUND_S)
    assert out.endings == [R, R, R, E]
    assert out[1].value == {"lr": 0.5}
    assert "ranks out of step: src rank 1 is in broadcast_from('setting')" in out[3].message
    assert "broadcast_from('other') on rank 3" in out[3].message


# ---- launches without a group, and the harness's view of a hang ---------------------------


def _collective_without_a_group(which: str) -> Any:
    if which == "all_reduce":
        return rw.all_reduce("early", lambda: 1, sum)
    return rw.broadcast_from("early", lambda: 1)


@pytest.mark.parametrize("which", ["all_reduce", "broadcast_from"])
def test_a_launched_rank_without_a_group_raises(run_on_ranks: Any, which: str) -> None:
    out = run_on_ranks(
        _collective_without_a_group, which, world_size=2, launch=True, timeout=BOUND_S
    )
    assert out.endings == [E, E]
    assert f"{which}('early'): this process is one of 2 launched ranks" in out[0].message
    assert "distributed_run()" in out[0].message


def _rank1_never_joins() -> None:
    if dist.get_rank() == 1:
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
    rw.all_reduce("batch_size", lambda: 1, sum)


def test_a_hang_names_the_labelled_collective(run_on_ranks: Any) -> None:
    out = run_on_ranks(_rank1_never_joins, world_size=2, timeout=2)
    assert out.endings == [Ending.HUNG, Ending.HUNG]
    assert out[0].where == "all_reduce('batch_size')"
    assert out[0].describe() == "hung in all_reduce('batch_size')"
    assert out[1].where == "" and "_rank1_never_joins" in out[1].stack


# ---- ranks in different collectives, and payloads weights_only refuses ---------------------


def _mixed_collectives(other_label: str) -> Any:
    """Ranks 0 and 1 in all_reduce('x'), ranks 2 and 3 in broadcast_from(other_label)."""
    if dist.get_rank() < 2:
        return rw.all_reduce("x", lambda: 1, sum)
    return rw.broadcast_from(other_label, lambda: 1)


@pytest.mark.parametrize("other_label", ["x", "y"])
def test_ranks_in_different_collectives_raise_out_of_step_on_every_rank(
    run_on_ranks: Any, other_label: str
) -> None:
    out = run_on_ranks(_mixed_collectives, other_label, world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E]
    for o in out:
        assert o.exc_name == "RuntimeError" and "ranks out of step" in o.message
        assert "rank 1 in all_reduce('x')" in o.message
        assert f"rank 2 in broadcast_from({other_label!r})" in o.message


class _Payload:
    """Runs a command when unpickled: what weights_only must refuse."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (__import__("os").system, (f"touch {self.marker}",))


def _send_a_malicious_value(which: str, marker: str) -> Any:
    """Rank 1, tampered, skips the wire format's own check and sends a code-running payload."""
    import io

    from rankwise import _wire

    real_encode = _wire.encode
    if dist.get_rank() == 1:
        buffer = io.BytesIO()
        torch.save({"evil": _Payload(marker)}, buffer)
        _wire.encode = lambda value, what: buffer.getvalue()  # type: ignore[assignment]
    try:
        if which == "all_reduce":
            return rw.all_reduce("step", lambda: 1, lambda xs: len(xs))
        return rw.broadcast_from("setting", lambda: 1, src=1)
    finally:
        _wire.encode = real_encode  # type: ignore[assignment]


@pytest.mark.parametrize("which", ["all_reduce", "broadcast_from"])
def test_a_payload_weights_only_refuses_names_the_call_and_sender(
    run_on_ranks: Any, which: str, tmp_path: Any
) -> None:
    marker = tmp_path / "payload-ran"
    out = run_on_ranks(_send_a_malicious_value, which, str(marker), world_size=2, timeout=BOUND_S)
    call = "all_reduce('step'): rank 1" if which == "all_reduce" else "broadcast_from('setting')"
    assert out.endings == [E, E]
    for o in out:
        assert o.exc_name == "RuntimeError", o.message
        assert o.message.startswith(call) and "rank 1" in o.message
        assert "does not load with torch.load(weights_only=True)" in o.message
        assert "weights_only=False" not in o.message and "False" not in o.message
    assert not marker.exists()


@pytest.mark.ranks(4)
def test_values_too_large_for_the_header_travel_after_it(rank: int) -> None:
    # Rank 2's value does not fit in its header; the others' do: all take the second round.
    sizes = rw.all_reduce("sizes", lambda: torch.ones(5000 if rank == 2 else 1), lambda xs: xs)
    assert [int(t.numel()) for t in sizes] == [1, 1, 5000, 1]
    big = rw.broadcast_from("big", lambda: torch.arange(5000.0), src=3)
    assert torch.equal(big, torch.arange(5000.0))


@pytest.mark.ranks(4)
def test_the_header_exchange_gives_every_rank_every_block_in_group_order(rank: int) -> None:
    # On gloo an all-to-all: each rank's block must land in its group slot on every rank.
    blocks = [bytes([r]) * 4096 for r in range(4)]
    assert _transport.all_gather_block(blocks[rank]) == b"".join(blocks)
    odd = dist.new_group([1, 3])
    if rank in (1, 3):
        assert _transport.all_gather_block(b"r%d" % rank, odd) == b"r1r3"
    dist.barrier()


def _broadcast_from_a_different_src() -> Any:
    return rw.broadcast_from("setting", lambda: 1, src=1 if dist.get_rank() == 2 else 0)


def test_ranks_naming_different_srcs_raise_on_every_rank(run_on_ranks: Any) -> None:
    out = run_on_ranks(_broadcast_from_a_different_src, world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E]
    for o in out:
        assert o.exc_name == "ValueError"
        assert "ranks disagree on src (rank 0: 0, rank 1: 0, rank 2: 1, rank 3: 0)" in o.message


def _raise_a_long_error() -> Any:
    def fn() -> int:
        if dist.get_rank() == 1:
            raise ValueError("x" * 10_000)
        return 1

    return rw.all_reduce("long", fn, sum)


def test_a_long_error_is_shortened_for_the_others(run_on_ranks: Any) -> None:
    out = run_on_ranks(_raise_a_long_error, world_size=2, timeout=BOUND_S)
    assert out.endings == [E, E]
    assert out[1].message == "x" * 10_000  # its own error, whole
    assert out[0].message.startswith("all_reduce('long'): rank 1 raised ValueError: xxx")
    assert out[0].message.endswith("...") and len(out[0].message) < 4096


def test_plain_values_travel_as_json_and_keep_their_types() -> None:
    from rankwise import _wire

    for value in (None, 3, 2.5, float("inf"), "x", True, [1, "a", None], {"step": 1, "ok": False}):
        data = _wire.encode(value, "test")
        assert data[:1] == b"J", value  # no torch.save, no pickle: nothing to refuse
        decoded = _wire.decode(data)
        assert decoded == value and type(decoded) is type(value)
    for value in ((1, 2), {0: "int key"}, torch.ones(2), [torch.ones(1)]):
        assert _wire.encode(value, "test")[:1] != b"J", value  # keeps its type via torch
        decoded = _wire.decode(_wire.encode(value, "test"))
        assert type(decoded) is type(value)


@pytest.mark.timeout(20)  # the bug was an endless loop: bounded here
@pytest.mark.parametrize("label", ["\U0001f600" * 400, "\x01" * 400, "b" * 5000])
def test_a_failure_report_fits_its_header_whatever_the_label(label: str) -> None:
    from rankwise._collectives import HEADER_BYTES, _words

    words = _words(f"all_reduce({label!r})", "ValueError: " + "\U0001f600" * 3000)
    assert len(words) <= HEADER_BYTES
    said = json.loads(words)
    assert said["call"].startswith("all_reduce(") and said["error"].startswith("ValueError: ")


def _one_rank_passes_a_bad_argument(which: str) -> Any:
    """Rank 1 alone passes what its call refuses; the others are right."""
    bad = dist.get_rank() == 1
    if which == "src":
        return rw.broadcast_from("cfg", lambda: 42, src=5 if bad else 0)
    if which == "src_type":
        return rw.broadcast_from("cfg", lambda: 42, src="0" if bad else 0)  # type: ignore[arg-type]
    if which == "bcast_label":
        return rw.broadcast_from(None if bad else "cfg", lambda: 42)  # type: ignore[arg-type]
    return rw.all_reduce(None if bad else "x", lambda: 1, sum)  # type: ignore[arg-type]


@pytest.mark.parametrize("which", ["src", "src_type", "bcast_label", "reduce_label"])
def test_a_bad_argument_on_one_rank_makes_every_rank_raise(run_on_ranks: Any, which: str) -> None:
    out = run_on_ranks(_one_rank_passes_a_bad_argument, which, world_size=3, timeout=BOUND_S)
    assert out.endings == [E, E, E], out.report()  # nobody waits for the bad rank
    assert out[1].exc_name in ("ValueError", "TypeError") and out[1].origin_rank == 1
    for o in (out[0], out[2]):
        assert o.exc_name == "RuntimeError" and o.origin_rank == 1, o.message
        assert "on rank 1 raised" in o.message or "out of step" in o.message


def _a_collective_inside_fn_on_rank_0_only() -> Any:
    def fn() -> int:
        if dist.get_rank() == 0:
            rw.broadcast_from("inner", lambda: 1)
        return 1

    return rw.all_reduce("outer", fn, sum)


def test_a_collective_only_some_ranks_run_inside_fn_raises_on_every_rank(
    run_on_ranks: Any,
) -> None:
    out = run_on_ranks(_a_collective_inside_fn_on_rank_0_only, world_size=2, timeout=BOUND_S)
    assert out.endings == [E, E], out.report()  # rank 0 joined no second exchange alone
    for o in out:
        assert "ranks out of step" in o.message and "broadcast_from('inner')" in o.message


def _a_bad_label_on_rank_0_inside_fn() -> Any:
    def fn() -> int:
        label = 5 if dist.get_rank() == 0 else "inner"
        return rw.all_reduce(label, lambda: 1, sum)  # type: ignore[arg-type]

    return rw.all_reduce("outer", fn, sum)


def test_a_bad_label_on_one_rank_inside_fn_leaves_no_rank_waiting(run_on_ranks: Any) -> None:
    # The inner exchange finds ranks out of step: every rank leaves the outer call too (none
    # joins its exchange alone), the bad rank with its own TypeError.
    out = run_on_ranks(_a_bad_label_on_rank_0_inside_fn, world_size=3, timeout=BOUND_S)
    assert out.endings == [E, E, E], out.report()
    assert out[0].exc_name == "TypeError", out.report()
    assert "label must be a str" in out[0].message
    for o in out:
        assert o.origin_rank == 0, o.message
    for o in (out[1], out[2]):
        assert "ranks out of step" in o.message and "all_reduce(5)" in o.message, o.message


def _outer_fails_on_rank_1_before_its_inner(inner: str) -> Any:
    def fn() -> int:
        if dist.get_rank() == 1:
            raise FileNotFoundError("shard-1.bin")
        if inner == "broadcast_from":
            return rw.broadcast_from("cfg", lambda: 4)  # type: ignore[no-any-return]
        return rw.all_reduce("cfg", lambda: 4, max)  # type: ignore[no-any-return]

    return rw.all_reduce("outer", fn, sum)


@pytest.mark.parametrize("inner", ["broadcast_from", "all_reduce"])
def test_fn_failing_on_one_rank_before_its_inner_collective_leaves_no_rank_waiting(
    run_on_ranks: Any, inner: str
) -> None:
    # Rank 1 is in the outer exchange while its peers are in the inner one: every rank
    # leaves both calls at once, rank 1 with its own error, the others naming it.
    out = run_on_ranks(
        _outer_fails_on_rank_1_before_its_inner, inner, world_size=3, timeout=BOUND_S
    )
    assert out.endings == [E, E, E], out.report()
    assert out[1].exc_name == "FileNotFoundError" and "shard-1.bin" in out[1].message
    for o in out:
        assert o.origin_rank == 1, o.message
    for o in (out[0], out[2]):
        assert "ranks out of step" in o.message and "FileNotFoundError: shard-1.bin" in o.message


class _Unprintable(Exception):
    def __str__(self) -> str:
        return self.detail  # type: ignore[attr-defined, no-any-return]  # never set


def _rank_1_fails_oddly(how: str) -> Any:
    def fn() -> int:
        if dist.get_rank() == 1:
            if how == "unprintable":
                raise _Unprintable()
            name = os.fsdecode(b"ckpt-\xff.pt")  # a file name that is not UTF-8: a surrogate
            raise ValueError(f"cannot read {name}")
        return 1

    if how == "broadcast_from":
        return rw.broadcast_from("cfg", fn, src=1)
    return rw.all_reduce("x", fn, sum)


@pytest.mark.parametrize("how", ["surrogate", "broadcast_from", "unprintable"])
def test_an_error_whose_text_cannot_travel_as_it_is_still_reaches_every_rank(
    run_on_ranks: Any, how: str
) -> None:
    out = run_on_ranks(_rank_1_fails_oddly, how, world_size=3, timeout=BOUND_S)
    assert out.endings == [E, E, E], out.report()
    assert out[1].exc_name in ("ValueError", "_Unprintable"), out[1].message
    for o in (out[0], out[2]):
        assert o.exc_name == "RuntimeError" and o.origin_rank == 1, o.message
        assert "rank 1 raised" in o.message


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr broke")


class _StrWithBadRepr(str):
    def __repr__(self) -> str:
        raise RuntimeError("repr broke")


def _odd_label_on_rank_1(how: str) -> Any:
    odd = {"surrogate": "step-\udcff", "bad_repr": _BadRepr(), "str_subclass": _StrWithBadRepr("x")}
    label = odd[how] if dist.get_rank() == 1 else "x"
    return rw.all_reduce(label, lambda: 1, sum)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["surrogate", "bad_repr", "str_subclass"])
def test_an_odd_label_on_one_rank_leaves_no_rank_waiting(run_on_ranks: Any, how: str) -> None:
    out = run_on_ranks(_odd_label_on_rank_1, how, world_size=3, timeout=BOUND_S)
    if how == "str_subclass":  # a str: the same label as its peers'
        assert out.values == [3, 3, 3], out.report()
        return
    assert out.endings == [E, E, E], out.report()
    for o in out:
        assert o.origin_rank == 1 or "out of step" in o.message, o.message


@pytest.mark.ranks(2)
def test_a_surrogate_label_on_every_rank_works_as_in_one_process(rank: int) -> None:
    assert rw.all_reduce("step-\udcff", lambda: 1, sum) == dist.get_world_size()


def _inner_failure_on_rank_2() -> Any:
    def fn() -> int:
        return rw.all_reduce("inner", lambda: 1 / (dist.get_rank() - 2), sum)  # type: ignore[no-any-return]

    return rw.all_reduce("outer", fn, sum)


def test_the_origin_rank_survives_an_enclosing_collective(run_on_ranks: Any) -> None:
    out = run_on_ranks(_inner_failure_on_rank_2, world_size=3, timeout=BOUND_S)
    assert out.endings == [E, E, E], out.report()
    assert [o.origin_rank for o in out] == [2, 2, 2], out.report()


def test_a_meta_tensor_is_refused_not_sent_without_its_data() -> None:
    from rankwise._wire import WireError, encode

    with pytest.raises(WireError, match="meta device"):
        encode({"w": torch.ones(2, device="meta")}, "all_reduce('w') on rank 0")
    encode({"w": torch.ones(2)}, "all_reduce('w') on rank 0")  # a real one travels


def _rank_1_dies_in_fn() -> Any:
    def fn() -> int:
        if dist.get_rank() == 1:
            os._exit(3)
        return 1

    return rw.all_reduce("x", fn, sum)


def test_a_peer_that_dies_in_fn_is_named_in_its_peers_errors(run_on_ranks: Any) -> None:
    # Not gloo's bare "Connection closed by peer": which call, on which rank, and what to do.
    out = run_on_ranks(_rank_1_dies_in_fn, world_size=3, timeout=BOUND_S)
    assert out[1].ending is Ending.HARD_EXIT, out.report()
    for o in (out[0], out[2]):
        assert o.ending is E, out.report()
        assert o.message.startswith("all_reduce('x') on rank"), o.message
        assert "a peer died, hung or never reached this collective" in o.message


def test_an_int_too_long_for_json_is_a_wire_error_saying_how_to_send_it() -> None:
    from rankwise._wire import WireError

    huge = 10**5000  # past Python's 4300-digit limit for int <-> str; weights_only refuses it
    for value in (huge, [1, {"n": -huge}]):
        with pytest.raises(WireError) as raised:
            _wire_round_trip(value)
        said = str(raised.value)
        assert "an int of more than 4300 digits" in said, said
        assert "hex(n)" in said and "int(text, 16)" in said, said
        assert "refused;" not in said  # torch's reason was lost: say what it was refused for
    assert int(_wire_round_trip(hex(huge)), 16) == huge  # what the message suggests travels


def test_a_weights_only_refusal_keeps_torchs_reason() -> None:
    from rankwise._wire import refusal

    text = (
        "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` "
        "will likely succeed.\nPlease file an issue: WeightsUnpickler error: \n\nUnsupported "
        "operand 139\n\nCheck the documentation of torch.load to learn more"
    )
    assert refusal(RuntimeError(text)) == "RuntimeError: Unsupported operand 139"


def _wire_round_trip(value: Any) -> Any:
    from rankwise import _wire

    return _wire.decode(_wire.encode(value, "test"))


def test_an_exit_code_a_header_cannot_hold_reads_as_a_failure() -> None:
    from rankwise._collectives import exit_code

    assert exit_code(SystemExit(2**64)) == 1 and exit_code(SystemExit(-3)) == -3


def test_a_view_travels_without_the_rest_of_its_storage() -> None:
    """torch.save keeps a view's whole storage: one row of a 16 MiB tensor sent 16 MiB."""
    from rankwise import _wire

    big = torch.arange(4 * 2**20, dtype=torch.float32).reshape(2048, 2048)
    leaf = torch.ones(8, 8, requires_grad=True)
    tagged = big[3]
    tagged.note = "kept"  # type: ignore[attr-defined]
    value = {"row": big[5, 10:20], "column": big[:, 7], "tagged": tagged, "grad": leaf[1]}
    data = _wire.encode(value, "test")
    assert len(data) < 64 * 1024, len(data)
    back = _wire.decode(data)
    assert torch.equal(back["row"], big[5, 10:20]) and torch.equal(back["column"], big[:, 7])
    assert torch.equal(back["tagged"], big[3]) and back["tagged"].note == "kept"
    assert back["grad"].requires_grad and torch.equal(back["grad"], leaf[1].detach())


def test_whole_storages_and_expanded_tensors_travel_as_they_are() -> None:
    from rankwise import _wire

    whole = torch.arange(6.0).reshape(2, 3).t()  # every element of its storage: not copied
    wide = torch.zeros(1).expand(2**20)  # one element stored: not made 4 MiB
    both = _wire.decode(_wire.encode((whole, whole[0], wide), "test"))
    assert both[0].stride() == whole.stride() and torch.equal(both[0], whole)
    assert torch.equal(both[1], whole[0]) and both[2].shape == wide.shape
    assert len(_wire.encode(wide, "test")) < 64 * 1024


def test_views_that_share_a_small_storage_travel_with_it_once() -> None:
    """Found by an adversarial pass: each overlapping view was sent as its own copy, 32x the
    bytes torch.save sends, and views sharing a storage no longer shared it."""
    import io

    from rankwise import _wire

    base = torch.arange(1500.0)
    windows = [base[i : i + 500] for i in range(1000)]
    saved = io.BytesIO()
    torch.save(windows, saved)
    data = _wire.encode(windows, "test")
    assert len(data) <= len(saved.getvalue()) * 1.1, (len(data), len(saved.getvalue()))
    back = _wire.decode(data)
    assert back[0].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()
    assert all(torch.equal(b, w) for b, w in zip(back, windows, strict=True))
    whole, row = _wire.decode(_wire.encode((base, base[3:7]), "test"))  # sent once, shared
    assert row.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert torch.equal(row, base[3:7])


# ---- the odd rank out is the origin -----------------------------------------------------------


def _broadcast_on(odd: int) -> Any:
    if dist.get_rank() == odd:
        return rw.broadcast_from("x", lambda: 1)
    return rw.all_reduce("x", lambda: 1, sum)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_one_rank_in_another_collective_is_the_origin(
    run_on_ranks: Any, world_size: int
) -> None:
    """Every rank raised the same error with no origin, so whichever rank raised first was
    named the root cause (rank 0 at 2 ranks, rank 6 at 8, the odd one being rank 7)."""
    odd = world_size - 1
    out = run_on_ranks(_broadcast_on, odd, world_size=world_size, timeout=BOUND_S)
    assert all(e is E for e in out.endings), out.report()
    for o in out:
        assert "ranks out of step" in o.message, o.message
        assert o.origin_rank == (odd if world_size > 2 else None), o.message


@pytest.mark.ranks(2)
def test_an_integer_like_src_is_taken(rank: int) -> None:
    import numpy as np

    assert rw.broadcast_from("np", lambda: rank, src=np.int64(1)) == 1
    assert rw.broadcast_from("tensor", lambda: rank, src=torch.tensor(1)) == 1
    with pytest.raises(TypeError, match=r"src must be an int rank; got 1\.0"):
        rw.broadcast_from("float", lambda: rank, src=1.0)  # type: ignore[arg-type]


# ---- a local failure is not blamed on a peer ---------------------------------------------------


def _rank_1_fails_locally_after_the_exchange() -> Any:
    def no_numpy(tensor: torch.Tensor) -> bytes:
        raise RuntimeError("Numpy is not available")

    real = _transport.host_bytes
    if dist.get_rank() == 1:
        _transport.host_bytes = no_numpy  # type: ignore[assignment]
    try:
        return rw.all_reduce("x", lambda: 1, sum)
    finally:
        _transport.host_bytes = real  # the rank serves later tests


def test_a_local_failure_while_bytes_move_is_not_blamed_on_a_peer(run_on_ranks: Any) -> None:
    """A torch without numpy failed in every labelled collective with "a peer died, hung or
    never reached this collective": a local error blamed on a peer."""
    out = run_on_ranks(_rank_1_fails_locally_after_the_exchange, world_size=3, timeout=BOUND_S)
    assert out[1].ending is E and out[1].message == "Numpy is not available", out.report()
    assert "peer" not in out[1].message


def test_bytes_come_off_a_tensor_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy is not a dependency (torch's CPU wheel does not need it): nothing may use it."""

    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    data = bytes(range(256)) * 3
    assert _transport.host_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == data
    assert _transport.host_bytes(torch.empty(0, dtype=torch.uint8)) == b""
