"""gather_bytes and gather_state_dicts: chunking, groups, bad input on one rank, no pickle."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import rankwise as rw
import torch
import torch.distributed as dist
from rankwise import _gather

from harness import Ending

E = Ending.RAISED
BOUND_S = 120  # a safety net far above the milliseconds these take (a busy machine included)


def _payload(rank: int) -> bytes:
    return bytes((rank * 7 + i) % 256 for i in range(rank * 11))  # rank 0 sends nothing


@pytest.mark.ranks(4)
@pytest.mark.parametrize("chunk_bytes", [1, 4, 1 << 20])
def test_gather_bytes_in_many_chunks_with_differing_lengths(
    rank: int, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("gather_bytes unpickled something")

    monkeypatch.setattr(pickle, "loads", refuse)  # nothing on the way may unpickle
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    out = rw.gather_bytes(memoryview(_payload(rank)), dst=2, chunk_bytes=chunk_bytes)
    if rank == 2:
        assert out == [bytearray(_payload(r)) for r in range(4)]
        assert all(isinstance(b, bytearray) for b in out)
    else:
        assert out is None


@pytest.mark.ranks(4)
def test_gather_bytes_over_a_group_to_a_global_rank(rank: int) -> None:
    odd = dist.new_group([1, 3])
    if rank in (1, 3):
        out = rw.gather_bytes(b"r%d" % rank, dst=3, group=odd, chunk_bytes=1)
        assert out == ([bytearray(b"r1"), bytearray(b"r3")] if rank == 3 else None)
    dist.barrier()


@pytest.mark.ranks(2)
def test_a_rank_outside_the_group_is_told_so(rank: int) -> None:
    alone = dist.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match=r"gather_bytes\(dst=0\): rank 1 is not a member"):
            rw.gather_bytes(b"x", dst=0, group=alone)
    dist.barrier()


@pytest.mark.ranks(4)
def test_all_empty_payloads(rank: int) -> None:
    assert rw.gather_bytes(b"", dst=0) == ([bytearray()] * 4 if rank == 0 else None)


def test_gather_bytes_in_a_single_process() -> None:
    assert rw.gather_bytes(b"abc", dst=0) == [bytearray(b"abc")]
    with pytest.raises(
        ValueError, match=r"dst must be the global rank of a member of the group \(\[0\]\); got 1"
    ):
        rw.gather_bytes(b"abc", dst=1)
    with pytest.raises(TypeError, match="data must be bytes, bytearray or memoryview; got str"):
        rw.gather_bytes("abc", dst=0)  # type: ignore[arg-type]


def _gather_with(bad: str) -> Any:
    rank = dist.get_rank()
    data: Any = b"x" * rank
    dst, chunk = 0, 8
    if bad == "data" and rank == 2:
        data = [1, 2, 3]
    if bad == "chunk":
        chunk = 0
    if bad == "dst":
        dst = 9
    return rw.gather_bytes(data, dst=dst, chunk_bytes=chunk)


def test_data_that_is_not_bytes_on_one_rank_raises_everywhere(run_on_ranks: Any) -> None:
    out = run_on_ranks(_gather_with, "data", world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E]
    assert out[2].exc_name == "TypeError" and "got list" in out[2].message
    assert out[0].message.startswith("gather_bytes(dst=0): rank 2 could not contribute: TypeError")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("chunk", "chunk_bytes must be a positive int; got 0"),
        ("dst", "dst must be the global rank"),
    ],
)
def test_bad_shared_arguments_raise_on_every_rank_at_once(
    run_on_ranks: Any, bad: str, message: str
) -> None:
    out = run_on_ranks(_gather_with, bad, world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E]
    assert all(o.exc_name == "ValueError" and message in o.message for o in out)


# ---- gather_state_dicts -----------------------------------------------------------------------


@pytest.mark.ranks(4)
def test_state_dicts_arrive_one_at_a_time_on_dst(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    real_decode = _gather._wire.decode

    def counting_decode(data: Any) -> Any:
        decoded.append(1)
        return real_decode(data)

    monkeypatch.setattr(_gather._wire, "decode", counting_decode)
    state = {"weight": torch.full((3,), float(rank)), "step": rank}
    states = rw.gather_state_dicts(state, dst=1)  # the exchange happens here, on every rank
    after_exchange = len(decoded)  # the sender's own round-trip check is counted here
    if rank != 1:
        assert list(states) == []
        return
    first = next(states)
    assert len(decoded) == after_exchange + 1  # only the first rank's dict is decoded so far
    rest = list(states)
    assert len(decoded) == after_exchange + 4
    assert [s["step"] for s in [first, *rest]] == [0, 1, 2, 3]
    assert all(
        s["weight"].device.type == "cpu" and s["weight"][0] == s["step"] for s in [first, *rest]
    )


class _Payload:
    """Runs a command when unpickled: what weights_only must refuse."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _send_a_malicious_state(marker: str) -> Any:
    rank = dist.get_rank()
    real_encode = _gather._wire.encode
    if rank == 1:  # a tampered sender skips the wire format's own check
        import io

        buffer = io.BytesIO()
        torch.save({"evil": _Payload(marker)}, buffer)
        _gather._wire.encode = lambda value, what: buffer.getvalue()
    try:
        states = rw.gather_state_dicts({"ok": torch.ones(1)}, dst=0)
        return [sorted(s) for s in states]
    finally:  # ranks stay warm for later tests: leave the module as it was
        _gather._wire.encode = real_encode


def test_a_malicious_payload_is_refused_and_never_run(run_on_ranks: Any, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    out = run_on_ranks(_send_a_malicious_state, str(marker), world_size=2, timeout=BOUND_S)
    assert out.endings == [E, Ending.RETURNED]
    assert "rank 1's state does not load with torch.load(weights_only=True)" in out[0].message
    assert "nothing in it was run" in out[0].message
    assert "weights_only=False" not in out[0].message  # never advise running it
    assert not marker.exists()


def _state_of(kind: str) -> Any:
    state: Any = {"w": torch.ones(1)} if kind == "ok" or dist.get_rank() != 1 else ["not", "a dict"]
    return list(rw.gather_state_dicts(state, dst=0))


def test_a_state_that_is_not_a_dict_raises_everywhere(run_on_ranks: Any) -> None:
    out = run_on_ranks(_state_of, "bad", world_size=2, timeout=BOUND_S)
    assert out.endings == [E, E]
    assert out[1].exc_name == "TypeError" and "state must be a dict; got list" in out[1].message
    assert "rank 1 could not contribute: TypeError" in out[0].message


# ---- arguments checked together, on every rank ------------------------------------------------


def _one_rank_passes(bad: str) -> Any:
    """Rank 1 alone passes a bad argument; the others pass good ones."""
    rank = dist.get_rank()
    data: Any = b"abcdefgh" * (rank + 1)
    dst, chunk = 0, 8
    if rank == 1:
        if bad == "chunk":
            chunk = 0
        elif bad == "noncontiguous":
            data = memoryview(b"abcdefgh")[::2]
        elif bad == "dst":
            dst = 9
    return rw.gather_bytes(data, dst=dst, chunk_bytes=chunk)


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ("chunk", "ValueError", "chunk_bytes must be a positive int; got 0"),
        ("noncontiguous", "TypeError", "data must be a contiguous"),
        ("dst", "ValueError", "dst must be the global rank of a member"),
    ],
)
def test_a_bad_argument_on_one_rank_raises_on_every_rank(
    run_on_ranks: Any, bad: str, error: str, message: str
) -> None:
    out = run_on_ranks(_one_rank_passes, bad, world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E]
    assert out[1].exc_name == error and message in out[1].message
    for r in (0, 2, 3):
        assert out[r].exc_name == "RuntimeError"
        assert out[r].message.startswith(
            f"gather_bytes(dst=0): rank 1 could not contribute: {error}"
        )


def _disagree_on(what: str) -> Any:
    rank = dist.get_rank()
    dst, chunk = 0, 8
    if what == "chunk_count" and rank == 1:
        chunk = 3  # 24 bytes: 8 chunks here, 3 elsewhere
    if what == "chunk_width" and rank == 1:
        chunk = 30  # one chunk everywhere, of another width
    if what == "dst" and rank == 1:
        dst = 1
    return rw.gather_bytes(b"x" * 24, dst=dst, chunk_bytes=chunk)


@pytest.mark.parametrize(
    ("what", "names"),
    [
        ("chunk_count", "chunk_bytes (rank 0: 8, rank 1: 3, rank 2: 8, rank 3: 8)"),
        ("chunk_width", "chunk_bytes (rank 0: 8, rank 1: 30, rank 2: 8, rank 3: 8)"),
        ("dst", "dst (rank 0: 0, rank 1: 1, rank 2: 0, rank 3: 0)"),
    ],
)
def test_ranks_disagreeing_on_chunk_bytes_or_dst_raise_on_every_rank(
    run_on_ranks: Any, what: str, names: str
) -> None:
    out = run_on_ranks(_disagree_on, what, world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E], [o.describe() for o in out]
    for o in out:
        assert o.exc_name == "ValueError" and f"ranks disagree on {names}" in o.message


def _gather_without_a_group() -> Any:
    return rw.gather_bytes(b"x", dst=0)


def test_a_launched_rank_without_a_group_raises_worded_as_the_collectives(
    run_on_ranks: Any,
) -> None:
    out = run_on_ranks(_gather_without_a_group, world_size=2, launch=True, timeout=BOUND_S)
    assert out.endings == [E, E]
    assert out[0].message == (
        "gather_bytes(dst=0): this process is one of 2 launched ranks (WORLD_SIZE=2) but no "
        "process group is set up; call it inside distributed_run(), or after "
        "torch.distributed.init_process_group()"
    )


def _gather_or_all_reduce() -> Any:
    if dist.get_rank() == 0:
        return rw.gather_bytes(b"x", dst=0)
    return rw.all_reduce("x", lambda: 1, sum)


def test_a_gather_out_of_step_with_a_collective_raises_everywhere(run_on_ranks: Any) -> None:
    out = run_on_ranks(_gather_or_all_reduce, world_size=2, timeout=BOUND_S)
    assert out.endings == [E, E]
    for o in out:
        assert "ranks out of step (rank 0 in gather_bytes(dst=0); rank 1 in all_reduce('x'))" in (
            o.message
        )


# ---- no argument value and no BaseException leaves a peer waiting ----------------------------


class _InterruptsWhenSaved:
    """A value whose saving is interrupted, as by Ctrl-C while a large state is encoded."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise KeyboardInterrupt


class _ExitingText(Exception):
    """An error whose text cannot be read: reading it raises a BaseException of its own."""

    def __init__(self, how: type[BaseException]) -> None:
        super().__init__()
        self.how = how

    def __str__(self) -> str:
        raise self.how()


def _one_rank_is_odd(how: str) -> Any:
    """Rank 1 alone passes an argument or value its peers do not; what it raised comes back
    as its value, so a BaseException on it cannot end the rank before its peers are seen."""
    rank = dist.get_rank()
    dst: Any = 0
    chunk: Any = 8
    if rank == 1:
        if how == "dst_2**63":
            dst = 2**63
        elif how == "chunk_2**63":
            chunk = 2**63
    try:
        if how == "interrupted_encode":
            state = {"w": _InterruptsWhenSaved() if rank == 1 else torch.ones(2)}
            return list(rw.gather_state_dicts(state, dst=0)) and "gathered"
        if how in ("str_interrupts", "str_exits"):
            kind = KeyboardInterrupt if how == "str_interrupts" else SystemExit

            def fn() -> int:
                if rank == 1:
                    raise _ExitingText(kind)
                return 1

            return rw.all_reduce("x", fn, sum)
        return rw.gather_bytes(b"abcdefgh", dst=dst, chunk_bytes=chunk)
    except (KeyboardInterrupt, SystemExit, _ExitingText) as exc:
        return f"rank 1 raised {type(exc).__name__}"


@pytest.mark.parametrize("how", ["dst_2**63", "chunk_2**63"])
def test_an_argument_too_large_for_the_header_on_one_rank_raises_on_every_rank(
    run_on_ranks: Any, how: str
) -> None:
    """It raised a bare struct.error on that rank before the exchange; its peers waited."""
    out = run_on_ranks(_one_rank_is_odd, how, world_size=4, timeout=BOUND_S)
    assert out.endings == [E, E, E, E], out.report()
    assert out[1].exc_name == "ValueError", out[1].message
    name = how.split("_")[0]
    assert f"{'chunk_bytes' if name == 'chunk' else 'dst'}" in out[1].message
    for r in (0, 2, 3):
        assert out[r].exc_name == "RuntimeError" and out[r].origin_rank == 1, out[r].message
        assert "rank 1 could not contribute: ValueError" in out[r].message


def test_an_interrupt_while_one_rank_encodes_its_state_reaches_every_rank(
    run_on_ranks: Any,
) -> None:
    """A KeyboardInterrupt outside fn (gather_state_dicts encoding the state) escaped on its
    rank before the exchange; its peers waited until the group's timeout."""
    out = run_on_ranks(_one_rank_is_odd, "interrupted_encode", world_size=3, timeout=BOUND_S)
    assert out[1].ending is Ending.RETURNED, out.report()
    assert out[1].value == "rank 1 raised KeyboardInterrupt"
    for r in (0, 2):
        assert out[r].ending is E and out[r].origin_rank == 1, out.report()
        assert "rank 1 could not contribute: KeyboardInterrupt" in out[r].message


@pytest.mark.parametrize("how", ["str_interrupts", "str_exits"])
def test_an_error_whose_text_raises_a_base_exception_reaches_every_rank(
    run_on_ranks: Any, how: str
) -> None:
    out = run_on_ranks(_one_rank_is_odd, how, world_size=3, timeout=BOUND_S)
    assert out[1].value == "rank 1 raised _ExitingText", out.report()  # its own error
    for r in (0, 2):
        assert out[r].ending is E and out[r].origin_rank == 1, out.report()
        assert "rank 1 raised _ExitingText (its message could not be read" in out[r].message


def _rank_1_dies_while_chunks_move() -> Any:
    if dist.get_rank() == 1:

        def die(*args: Any, **kwargs: Any) -> Any:
            os._exit(3)

        dist.send = die  # type: ignore[assignment]  # after the header: in the chunk phase
    return rw.gather_bytes(b"x" * 64, dst=0, chunk_bytes=8)


def test_a_peer_dying_while_chunks_move_is_named_with_the_call(run_on_ranks: Any) -> None:
    """gloo's bare "Connection reset by peer" named neither the call nor what to do."""
    out = run_on_ranks(_rank_1_dies_while_chunks_move, world_size=3, timeout=BOUND_S)
    assert out[1].ending is Ending.HARD_EXIT, out.report()
    assert out[0].ending is E, out.report()
    assert out[0].message.startswith("gather_bytes(dst=0) on rank 0: moving data with its peers"), (
        out[0].message
    )
    assert "a peer died, hung or never reached this collective" in out[0].message


# ---- disagreements name the odd rank ----------------------------------------------------------


def _chunk_differs_on(odd: int) -> Any:
    chunk = 3 if dist.get_rank() == odd else 8
    return rw.gather_bytes(b"x" * 24, dst=0, chunk_bytes=chunk)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_one_rank_that_disagrees_is_the_origin(run_on_ranks: Any, world_size: int) -> None:
    odd = world_size - 1
    out = run_on_ranks(_chunk_differs_on, odd, world_size=world_size, timeout=BOUND_S)
    assert all(e is E for e in out.endings), out.report()
    for o in out:
        assert o.exc_name == "ValueError" and "ranks disagree on chunk_bytes" in o.message
        if world_size == 2:  # one against one: neither is the odd one
            assert o.origin_rank is None, o.message
        else:
            assert o.origin_rank == odd, o.message
            assert f"rank {odd} differs from every other rank" in o.message, o.message


def test_integer_like_dst_and_chunk_bytes_are_taken(run_on_ranks: Any) -> None:
    out = run_on_ranks(_numpy_arguments, world_size=2, timeout=BOUND_S)
    assert out.values == [[bytearray(b"r0"), bytearray(b"r1")], None], out.report()


def _numpy_arguments() -> Any:
    import numpy as np

    rank = dist.get_rank()
    return rw.gather_bytes(b"r%d" % rank, dst=np.int64(0), chunk_bytes=np.int32(1))


class _ExitingRepr:
    """An argument whose repr (and __index__) raise a BaseException: named before the
    exchange, it escaped on its rank and left the peers waiting."""

    def __repr__(self) -> str:
        raise KeyboardInterrupt

    def __index__(self) -> int:
        raise SystemExit(3)


def _odd_argument_on_rank_1(call: str) -> Any:
    odd: Any = _ExitingRepr() if dist.get_rank() == 1 else 0
    try:
        if call == "gather_bytes":
            return rw.gather_bytes(b"x", dst=odd)
        return rw.broadcast_from("x", lambda: 1, src=odd)
    except (KeyboardInterrupt, SystemExit) as exc:
        return f"escaped: {type(exc).__name__}"


@pytest.mark.parametrize("call", ["gather_bytes", "broadcast_from"])
def test_an_argument_whose_repr_exits_leaves_no_peer_waiting(run_on_ranks: Any, call: str) -> None:
    out = run_on_ranks(_odd_argument_on_rank_1, call, world_size=3, timeout=BOUND_S)
    assert out.endings == [E, E, E], out.report()
    assert "whose repr raised" in out[1].message, out[1].message
    for r in (0, 2):
        assert out[r].origin_rank == 1, out[r].message
