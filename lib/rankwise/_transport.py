"""Moving bytes between ranks as uint8 tensors, on the device the group's backend needs.

No pickle anywhere: only tensors of bytes cross the wire. gloo moves CPU tensors; NCCL needs
them on this rank's current CUDA device, and they come back to host memory afterwards. No
numpy either (torch's CPU wheel runs without it). Every call into the backend runs inside
`link()`, so that only its failures read as a peer's: a local error stays what it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rankwise import _watch
from rankwise._watch import PeersLost

# all_gather_into_tensor's new name (torch 2.13 deprecates the old one); older builds, such
# as a GPU machine's own CUDA torch, have only the old.
_all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class LinkError(RuntimeError):
    """The backend failed to move bytes with the peers (a peer died, hung or left)."""


@contextlib.contextmanager
def link() -> Iterator[None]:
    """Around a call into the backend: its RuntimeError (gloo's "Connection closed by peer",
    a timeout) becomes a LinkError, which callers word as the peers' failure."""
    try:
        yield
    except (LinkError, PeersLost):
        raise
    except RuntimeError as exc:
        raise LinkError(str(exc)) from exc


def settle(work: Any) -> None:
    """Wait for an async collective's `work`; on a launch, through the peer watch, which
    raises PeersLost for peers silent past its bound instead of waiting the group out."""
    if work is not None:
        _watch.wait(work)


def run(collective: Callable[[bool], Any]) -> None:
    """Run `collective(async_op)`: as it is where no peer watch runs (no launch), else async
    and waited for through the watch."""
    if _watch.current() is None:
        collective(False)
    else:
        settle(collective(True))


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
    """Every rank's equal-sized `tensor`, concatenated into `output`, in group order."""
    with link():
        run(lambda a: _all_gather_single(output, tensor, group=group, async_op=a))


def all_gather_block(block: bytes | bytearray, group: Any = None) -> bytes:
    """Every rank's `block` (the same length on every rank), concatenated in group order.

    On gloo as an all-to-all of `block` repeated once per rank: each rank sends straight to
    every other in one round, where gloo's all_gather is a ring (one round per rank) and a
    gather then a broadcast takes two. Elsewhere (NCCL, in-process backends) one all_gather.
    """
    count = dist.get_world_size(group)
    device = exchange_device(group)
    out = torch.empty(count * len(block), dtype=torch.uint8, device=device)
    if device.type == "cpu" and "gloo" in str(dist.get_backend(group)).lower():
        repeated = bytearray(block) * count  # in Python: cheaper than a tensor's repeat()
        mine = torch.frombuffer(repeated, dtype=torch.uint8)
        with link():
            run(lambda a: dist.all_to_all_single(out, mine, group=group, async_op=a))
    else:
        mine = torch.frombuffer(bytearray(block), dtype=torch.uint8)
        all_gather_single(out, mine if device.type == "cpu" else mine.to(device), group)
    return host_bytes(out)


def exchange_device(group: Any = None) -> torch.device:
    """Where the group's collectives need their tensors."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_buffer(piece: bytes | memoryview, width: int, device: torch.device) -> torch.Tensor:
    """A `width`-byte tensor on `device` holding `piece`, zero-padded: one copy of the data."""
    host = torch.empty(width, dtype=torch.uint8)
    if len(piece):
        with warnings.catch_warnings():  # read-only source: we only read it, once
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            host[: len(piece)].copy_(torch.frombuffer(piece, dtype=torch.uint8))
    if len(piece) < width:
        host[len(piece) :].zero_()
    return host if device.type == "cpu" else host.to(device)


def readonly_tensor(piece: memoryview) -> torch.Tensor:
    """A uint8 tensor over `piece`'s memory, no copy; only ever read (sent), never written."""
    if not len(piece):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(piece, dtype=torch.uint8)


def receive_buffer(
    target: bytearray, offset: int, width: int, device: torch.device
) -> tuple[torch.Tensor, bool]:
    """Where `width` bytes for `target[offset:]` land; True when they land in `target` itself.

    On the CPU, a slot that `target` covers entirely is a view of it: no copy afterwards.
    """
    if device.type == "cpu" and len(target) >= offset + width > 0:
        return torch.frombuffer(target, dtype=torch.uint8, count=width, offset=offset), True
    return torch.empty(width, dtype=torch.uint8, device=device), False


def copy_out(tensor: torch.Tensor, length: int, target: bytearray, offset: int = 0) -> None:
    """Copy the first `length` bytes of a uint8 tensor into `target` at `offset`."""
    if length <= 0:
        return
    host = tensor[:length].contiguous().cpu()
    window = (ctypes.c_char * length).from_buffer(target, offset)
    ctypes.memmove(window, host.data_ptr(), length)


def host_bytes(tensor: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes, wherever it lives: one copy to the host, one into bytes."""
    return to_bytes(tensor, tensor.numel())


def to_bytes(tensor: torch.Tensor, length: int) -> bytes:
    """The first `length` bytes of a uint8 tensor: one copy from host memory into bytes."""
    if length <= 0:
        return b""
    host = tensor[:length].contiguous().cpu()
    return ctypes.string_at(host.data_ptr(), length)


def all_gather_bytes(data: bytes, group: Any = None) -> list[bytes]:
    """Every rank's `data`, in group order, on every rank (lengths may differ)."""
    device = exchange_device(group)
    count = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(count)]
    with link():
        run(lambda a: dist.all_gather(lengths, length, group=group, async_op=a))
    sizes = [int(t.item()) for t in lengths]
    longest = max(sizes)
    mine = send_buffer(memoryview(data), longest, device)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(count)]
    with link():
        run(lambda a: dist.all_gather(gathered, mine, group=group, async_op=a))
    return [to_bytes(t, n) for t, n in zip(gathered, sizes, strict=False)]


def broadcast_bytes(data: bytes | None, src: int, group: Any = None) -> bytes:
    """`data` from global rank `src` on every rank (pass None on the others)."""
    device = exchange_device(group)
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    with link():
        run(lambda a: dist.broadcast(length, src, group=group, async_op=a))
    size = int(length.item())
    if data is not None:
        buffer = send_buffer(memoryview(data), size, device)
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        with link():
            run(lambda a: dist.broadcast(buffer, src, group=group, async_op=a))
    return data if data is not None else to_bytes(buffer, size)


def all_gather_known(data: bytes, sizes: list[int], group: Any = None) -> list[bytes]:
    """Every rank's `data`, whose lengths `sizes` every rank already knows: one collective."""
    device = exchange_device(group)
    longest = max(sizes)
    if longest == 0:
        return [b""] * len(sizes)
    mine = send_buffer(memoryview(data), longest, device)
    gathered = torch.empty(longest * len(sizes), dtype=torch.uint8, device=device)
    all_gather_single(gathered, mine, group)
    host = gathered.cpu()
    return [to_bytes(host[i * longest :], n) for i, n in enumerate(sizes)]


def broadcast_known(data: bytes | None, size: int, src: int, group: Any = None) -> bytes:
    """`data` (`size` bytes, a length every rank knows) from global rank `src`: one collective."""
    if size == 0:
        return b""
    device = exchange_device(group)
    if data is not None:
        sent = send_buffer(memoryview(data), size, device)
        with link():
            run(lambda a: dist.broadcast(sent, src, group=group, async_op=a))
        return data
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    with link():
        run(lambda a: dist.broadcast(buffer, src, group=group, async_op=a))
    return to_bytes(buffer, size)
