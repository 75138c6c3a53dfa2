"""Gathering bytes and state dicts to one rank, in bounded chunks, without pickle.

Both exchange a small header first (each rank's length, or the error that kept it from
contributing), so a rank with bad input makes every rank raise instead of leaving the others
waiting; then the data moves `chunk_bytes` per rank at a time, bounding device memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from rankwise import _points, _transport, _wire
from rankwise._launch import is_initialized, launch_world_size, rank
from rankwise._wire import Record

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
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
    on every rank before anyone waits: `chunk_bytes` or `dst` at once, and data that is not
    bytes-like on one rank through the header exchange.
    """
    what = f"gather_bytes(dst={dst})"
    _check_chunk(what, chunk_bytes)
    error = None
    if not isinstance(data, _BYTES_LIKE):
        error = TypeError(
            f"{what} on rank {rank()}: data must be bytes, bytearray or memoryview; got "
            f"{type(data).__name__}. Encode it first (e.g. torch.save to a BytesIO)"
        )
        data = b""
    return _gather(what, memoryview(data).cast("B"), error, dst, group, chunk_bytes)


def gather_state_dicts(
    state: dict[str, Any], dst: int, group: Any = None
) -> Iterator[dict[str, Any]]:
    """Gather every rank's `state` dict to global rank `dst`, loaded with weights_only.

    The exchange runs now, eagerly, so every rank must call this even if it never iterates.
    On `dst` the iterator yields one rank's dict at a time, in group order, decoding each
    only when reached, so host memory holds one decoded dict at a time. Elsewhere it is
    empty. A payload that would run code when loaded is refused, never run.
    """
    what = f"gather_state_dicts(dst={dst})"
    error: BaseException | None = None
    blob = b""
    try:
        if not isinstance(state, dict):
            raise TypeError(
                f"{what} on rank {rank()}: state must be a dict; got {type(state).__name__}"
            )
        blob = _wire.encode(state, f"{what} on rank {rank()}")
    except Exception as exc:
        error = exc
    blobs = _gather(what, memoryview(blob), error, dst, group, DEFAULT_CHUNK_BYTES)
    if blobs is None:
        return iter(())
    return _decode_each(what, blobs, _members(group))


def _decode_each(what: str, blobs: list[bytearray], members: list[int]) -> Iterator[dict[str, Any]]:
    for i, member in enumerate(members):
        blob, blobs[i] = blobs[i], bytearray()  # drop each rank's bytes once decoded
        try:
            state = _wire.decode(blob)
        except Exception as exc:
            raise RuntimeError(
                f"{what}: rank {member}'s state does not load with torch.load(weights_only="
                f"True) ({type(exc).__name__}: {exc}); it was refused, nothing in it was run"
            ) from exc
        del blob
        yield state


def _check_chunk(what: str, chunk_bytes: int) -> None:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"{what}: chunk_bytes must be a positive int; got {chunk_bytes!r}")


def _members(group: Any) -> list[int]:
    if not is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _gather(
    what: str,
    data: memoryview,
    error: BaseException | None,
    dst: int,
    group: Any,
    chunk_bytes: int,
) -> list[bytearray] | None:
    members = _single_or_members(what, group)
    if isinstance(dst, bool) or not isinstance(dst, int) or dst not in members:
        raise ValueError(
            f"{what}: dst must be the global rank of a member of the group ({members}); got {dst!r}"
        )
    if len(members) == 1:
        if error is not None:
            raise error
        return [bytearray(data)]
    with _points.point("gather", what):
        mine = Record(
            "gather",
            what,
            "error" if error else "ok",
            error=f"{type(error).__name__}: {error}" if error else "",
            size=len(data),
        )
        headers = [
            Record.from_bytes(b) for b in _transport.all_gather_bytes(mine.to_bytes(), group)
        ]
        _raise_for_headers(what, mine, error, headers, members)
        return _gather_chunks(data, [h.size for h in headers], dst, group, chunk_bytes)


def _single_or_members(what: str, group: Any) -> list[int]:
    if not is_initialized() and launch_world_size() > 1:
        raise RuntimeError(
            f"{what}: this process is one of {launch_world_size()} launched ranks but no "
            f"process group is set up; call it inside distributed_run()"
        )
    return _members(group)


def _raise_for_headers(
    what: str, mine: Record, error: BaseException | None, headers: list[Record], members: list[int]
) -> None:
    if any(h.call != mine.call for h in headers):
        where = "; ".join(f"rank {m} in {h.label}" for m, h in zip(members, headers, strict=False))
        raise RuntimeError(f"{what} on rank {rank()}: ranks out of step ({where})")
    failed = [(m, h) for m, h in zip(members, headers, strict=False) if h.status == "error"]
    if failed:
        if error is not None:
            raise error
        member, header = failed[0]
        raise RuntimeError(f"{what}: rank {member} could not contribute: {header.error}")


def _gather_chunks(
    data: memoryview, lengths: list[int], dst: int, group: Any, chunk_bytes: int
) -> list[bytearray] | None:
    device = _transport.exchange_device(group)
    out = [bytearray(n) for n in lengths] if rank() == dst else None
    longest = max(lengths)
    for offset in range(0, longest, chunk_bytes):
        width = min(chunk_bytes, longest - offset)
        send = _transport.send_buffer(data[offset : offset + width], width, device)
        if out is None:
            dist.gather(send, None, dst=dst, group=group)
            continue
        slots = [_transport.receive_buffer(target, offset, width, device) for target in out]
        dist.gather(send, [slot for slot, _ in slots], dst=dst, group=group)
        for target, (slot, in_place), length in zip(out, slots, lengths, strict=True):
            if not in_place:
                _transport.copy_out(slot, max(0, min(width, length - offset)), target, offset)
        del send, slots
    return out
