"""Gathering bytes and state dicts to one rank, in bounded chunks, without pickle.

Both start with the labelled collectives' header exchange (each rank's length, dst and
chunk size, or the error that kept it from contributing), so a rank with bad input makes
every rank raise instead of leaving the others waiting; then the data moves `chunk_bytes`
per rank at a time, bounding device memory. On the CPU each chunk lands straight in dst's
result buffers, so dst's memory grows by little more than the bytes it returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rankwise import _fake, _points, _transport, _watch, _wire
from rankwise._collectives import (
    Call,
    Entry,
    as_header_int,
    as_rank,
    describe,
    exchange,
    exit_code,
    peers_answering,
    raise_for_failures,
    raise_if_disagreeing,
    shown,
    single_process,
)
from rankwise._launch import is_initialized, rank

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
_INT64_MAX = 2**63 - 1  # the header carries chunk_bytes as an int64
_BYTES_LIKE = (bytes, bytearray, memoryview)


def gather_bytes(
    data: bytes | bytearray | memoryview,
    dst: int,
    group: Any = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[bytearray] | None:
    """Gather every rank's bytes to global rank `dst`; no pickle runs anywhere.

    Returns the group's bytes in group order on `dst` and None on the other ranks. Lengths
    may differ per rank. At most `chunk_bytes` per rank move at a time. Bad arguments raise
    on every rank before anyone waits: each rank's are checked, and `dst` and `chunk_bytes`
    compared, in the first exchange; a rank with a bad one raises its own error, the others
    a RuntimeError naming it, and ranks that disagree all raise a ValueError naming the values.
    """
    dst, chunk_bytes = as_rank(dst), as_rank(chunk_bytes)
    call = Call("gather_bytes", "", f"gather_bytes(dst={shown(dst)})")
    view: memoryview | bytes = b""
    error: BaseException | None = None
    try:
        _check_chunk(call.text, chunk_bytes)
        view = _byte_view(call.text, data)
    except BaseException as exc:  # any at all: the peers learn of it in the exchange
        error = exc
    return _gather(call, view, error, dst, group, chunk_bytes)


def gather_state_dicts(
    state: dict[str, Any], dst: int, group: Any = None
) -> Iterator[dict[str, Any]]:
    """Gather every rank's `state` dict to global rank `dst`, loaded with weights_only.

    The exchange runs now, eagerly, so every rank must call this even if it never iterates.
    On `dst` the iterator yields one rank's dict at a time, in group order, decoding each
    only when reached, so host memory holds one decoded dict at a time. Elsewhere it is
    empty. A payload that would run code when loaded is refused, never run.
    """
    dst = as_rank(dst)
    call = Call("gather_state_dicts", "", f"gather_state_dicts(dst={shown(dst)})")
    error: BaseException | None = None
    blob = b""
    try:
        if not isinstance(state, dict):
            raise TypeError(
                f"{call.text} on rank {rank()}: state must be a dict; got {type(state).__name__}"
            )
        blob = _wire.encode(state, f"{call.text} on rank {rank()}")
    except BaseException as exc:  # Ctrl-C while encoding too: the peers must not wait
        error = exc
    blobs = _gather(call, memoryview(blob), error, dst, group, DEFAULT_CHUNK_BYTES)
    if blobs is None:
        return iter(())
    return _decode_each(call.text, blobs, _members(group))


def _decode_each(what: str, blobs: list[bytearray], members: list[int]) -> Iterator[dict[str, Any]]:
    for i, member in enumerate(members):
        blob, blobs[i] = blobs[i], bytearray()  # drop each rank's bytes once decoded
        try:
            state = _wire.decode(blob)
        except Exception as exc:
            raise RuntimeError(
                f"{what}: rank {member}'s state does not load with torch.load(weights_only="
                f"True) ({_wire.refusal(exc)}); it was refused, nothing in it was run"
            ) from None
        del blob
        yield state


def _check_chunk(what: str, chunk_bytes: int) -> None:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"{what}: chunk_bytes must be a positive int; got {shown(chunk_bytes)}")
    if chunk_bytes > _INT64_MAX:
        raise ValueError(
            f"{what}: chunk_bytes={chunk_bytes} is past 2**63 - 1; pass at most that (no "
            f"rank sends more in one chunk than it has)"
        )


def _byte_view(what: str, data: Any) -> memoryview:
    """`data` as flat bytes without copying it; a clear error for what cannot be that."""
    if not isinstance(data, _BYTES_LIKE):
        raise TypeError(
            f"{what} on rank {rank()}: data must be bytes, bytearray or memoryview; got "
            f"{type(data).__name__}. Encode it first (e.g. torch.save to a BytesIO)"
        )
    view = memoryview(data)
    if not view.c_contiguous:
        raise TypeError(
            f"{what} on rank {rank()}: data must be a contiguous buffer; got a non-contiguous "
            f"memoryview (a strided slice?). Pass bytes(data), which copies it"
        )
    return view.cast("B")


def _members(group: Any) -> list[int]:
    if not is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _gather(
    call: Call,
    data: memoryview | bytes,
    error: BaseException | None,
    dst: int,
    group: Any,
    chunk_bytes: int,
) -> list[bytearray] | None:
    solo = single_process(call.text, group)
    members = _members(group)
    if not solo and rank() not in members:  # alone: the members do not wait for it
        raise ValueError(
            f"{call.text}: rank {rank()} is not a member of the group ({members}); call it "
            f"on the group's members only"
        )
    try:
        _check_dst(call.text, dst, members)
    except ValueError as exc:
        error = error or exc
    if solo:
        if error is not None:
            raise error
        return [bytearray(data)]
    with _points.point("gather", call.text):  # the point as the harness knows it
        if _fake.on_fake_world(group):  # dst alone needs the others' data
            if error is not None:
                raise error
            if rank() == dst:
                raise _fake.not_simulated(call.text, rank(), group, "the data")
            return None
        headers = exchange(call, _entry(data, error, dst, chunk_bytes), group)
        raise_for_failures(headers, error, failed_as="could not contribute:")
        raise_if_disagreeing(headers, "dst", [e.root for e in headers.entries])
        raise_if_disagreeing(headers, "chunk_bytes", [e.chunk for e in headers.entries])
        lengths = [e.length for e in headers.entries]
        with peers_answering(call):  # a peer dying mid-way: name the call, not gloo's words
            return _gather_chunks(memoryview(data), lengths, dst, group, chunk_bytes)


def _entry(data: memoryview | bytes, error: BaseException | None, dst: Any, chunk: Any) -> Entry:
    """This rank's header: its length, dst and chunk size (each as the header can hold it:
    a value refused before is never compared), or what kept it from contributing."""
    if isinstance(error, SystemExit):
        return Entry("exit", code=exit_code(error))
    return Entry(
        "error" if error is not None else "ok",
        length=len(data),
        root=as_header_int(dst),
        chunk=as_header_int(chunk),
        error=describe(error) if error is not None else "",
    )


def _check_dst(what: str, dst: int, members: list[int]) -> None:
    if isinstance(dst, bool) or not isinstance(dst, int) or dst not in members:
        raise ValueError(
            f"{what}: dst must be the global rank of a member of the group ({members}); "
            f"got {shown(dst)}"
        )


def _gather_chunks(
    data: memoryview, lengths: list[int], dst: int, group: Any, chunk_bytes: int
) -> list[bytearray] | None:
    """Move every rank's bytes to `dst`, `chunk_bytes` per rank at a time."""
    device = _transport.exchange_device(group)
    if device.type == "cpu":
        return _receive_in_place(data, lengths, dst, group, chunk_bytes)
    return _gather_through_device(data, lengths, dst, group, chunk_bytes, device)


def _receive_in_place(
    data: memoryview, lengths: list[int], dst: int, group: Any, chunk_bytes: int
) -> list[bytearray] | None:
    """On the CPU, each rank's chunk lands straight in dst's result buffer, point to point:
    a gather through the backend would stage every rank's chunk in one more buffer."""
    members = _members(group)
    me = rank()
    if me != dst:
        for offset in range(0, len(data), chunk_bytes):
            piece = data[offset : offset + chunk_bytes]
            sent = _transport.readonly_tensor(piece)
            with _transport.link():
                if _watch.current() is None:
                    dist.send(sent, dst=dst, group=group)
                else:
                    _transport.settle(dist.isend(sent, dst=dst, group=group))
        return None
    out = [bytearray(n) for n in lengths]
    for offset in range(0, max(lengths, default=0), chunk_bytes):
        with _transport.link():
            waits = [
                dist.irecv(_window(target, offset, chunk_bytes), src=member, group=group)
                for member, target in zip(members, out, strict=True)
                if member != me and offset < len(target)
            ]
        if offset == 0:  # receives posted first: bytes arriving early would be staged
            memoryview(out[members.index(me)])[:] = data  # bytearray[:] = would copy twice
        for work in waits:
            if work is not None:
                with _transport.link():
                    _transport.settle(work)  # work.wait(), through the watch on a launch
    return out


def _window(target: bytearray, offset: int, chunk_bytes: int) -> torch.Tensor:
    width = min(chunk_bytes, len(target) - offset)
    return torch.frombuffer(target, dtype=torch.uint8, count=width, offset=offset)


def _gather_through_device(
    data: memoryview,
    lengths: list[int],
    dst: int,
    group: Any,
    chunk_bytes: int,
    device: torch.device,
) -> list[bytearray] | None:
    """On an accelerator (NCCL), a gather per chunk through device buffers, copied out."""
    out = [bytearray(n) for n in lengths] if rank() == dst else None
    longest = max(lengths)
    for offset in range(0, longest, chunk_bytes):
        width = min(chunk_bytes, longest - offset)
        send = _transport.send_buffer(data[offset : offset + width], width, device)
        if out is None:
            with _transport.link():  # NCCL: its own watchdog bounds it (no peer watch)
                dist.gather(send, None, dst=dst, group=group)
            continue
        slots = [_transport.receive_buffer(target, offset, width, device) for target in out]
        with _transport.link():
            dist.gather(send, [slot for slot, _ in slots], dst=dst, group=group)
        for target, (slot, in_place), length in zip(out, slots, lengths, strict=True):
            if not in_place:
                _transport.copy_out(slot, max(0, min(width, length - offset)), target, offset)
        del send, slots
    return out
