"""The one wire format for values: JSON for plain values, else torch.save bytes that must
load back with weights_only.

Plain values (None, bool, int, float, str, and lists and str-keyed dicts of them, exactly
those types) travel as JSON behind a one-byte tag: no pickle and no torch.load, so small
values cost what torch's object collectives cost. Anything else (tensors, tuples, other
keys) is torch.save bytes and counts as sendable only if it loads back with
``weights_only=True`` on the rank that produced it, so a value the receivers could not load
fails where it was made, before any rank waits for it. Loading never runs arbitrary code.
A view of part of a larger storage travels as a copy of its own elements when that is
smaller (one row of a large tensor); views that overlap, or go with their whole storage,
share it on arrival as torch.save keeps them.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import torch

_REGISTER_HINT = (
    "return plain values (tensors, numbers, strings, lists, tuples, dicts), or register the "
    "class on every rank with torch.serialization.add_safe_globals([YourClass]) before the call"
)


class WireError(TypeError):
    """A value cannot travel between ranks in rankwise's wire format."""


_JSON = b"J"  # torch.save's zip output starts with b"PK": the tags never collide
_MAX_DEPTH = 32


def encode(value: Any, what: str) -> bytes:
    """`value` as bytes: JSON if plain, else torch.save checked to load with weights_only."""
    if _plain(value, 0):
        try:
            text = json.dumps(value, allow_nan=True, separators=(",", ":"))
            json.loads(text)  # the limit applies when reading too
        except ValueError:  # an int past Python's digit limit; weights_only refuses it too
            raise WireError(
                f"{what}: the value holds an int of more than {sys.get_int_max_str_digits()} "
                f"digits, which neither JSON nor torch.load(weights_only=True) carries; send "
                f"it as hex(n) and read it back with int(text, 16)"
            ) from None
        return _JSON + text.encode()
    tensors = list(_tensors_in(value, set()))
    if any(t.is_meta for t in tensors):
        raise WireError(
            f"{what}: a tensor on the meta device has no data to send; materialize it first "
            f"(load its weights, or to_empty()), or send its shape and dtype instead"
        )
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer, pickle_module=_compacting(_worth_compacting(tensors)))
    except Exception as exc:
        raise WireError(
            f"{what}: the value of type {type(value).__name__} cannot be saved with "
            f"torch.save ({type(exc).__name__}: {exc}); {_REGISTER_HINT}"
        ) from exc
    data = buffer.getvalue()
    try:
        decode(data)
    except Exception as exc:
        raise WireError(
            f"{what}: the value of type {type(value).__name__} does not load back with "
            f"torch.load(weights_only=True) ({refusal(exc)}); {_REGISTER_HINT}"
        ) from None  # torch's own text advises weights_only=False: never pass that on
    return data


def _worth_compacting(tensors: list[torch.Tensor]) -> set[int]:
    """The storages (by address) whose tensors here should travel as copies of their own
    elements: torch.save keeps a view's whole storage, so one row of a large tensor would
    send it all. Only where the copies are smaller than the storage, and no tensor here uses
    all of it: overlapping views of one storage travel with it once, sharing it as before."""
    used: dict[int, int] = {}  # the bytes the tensors of each storage use, added up
    whole: set[int] = set()
    sizes: dict[int, int] = {}
    for tensor in tensors:
        if not _plain_storage(tensor):
            continue
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        own = tensor.numel() * tensor.element_size()
        sizes[key] = size
        used[key] = used.get(key, 0) + own
        if own >= size:
            whole.add(key)
    return {key for key, size in sizes.items() if key not in whole and used[key] < size}


def _compacting(storages: set[int]) -> Any:
    """What torch.save needs of a pickle module, with a pickler that saves each tensor of
    `storages` as a copy of its own elements (plain pickle where there is none)."""
    if not storages:
        return pickle

    class CompactPickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is torch.Tensor and _compacted(obj, storages):
                copy = obj.detach().clone()
                copy.requires_grad_(obj.requires_grad)
                copy.__dict__.update(obj.__dict__)  # attributes set on the tensor travel too
                return copy.__reduce_ex__(torch.serialization.DEFAULT_PROTOCOL)  # type: ignore[no-untyped-call]
            return NotImplemented

    class Compacting:
        Pickler = CompactPickler
        Unpickler = pickle.Unpickler

    return Compacting


def _compacted(tensor: torch.Tensor, storages: set[int]) -> bool:
    return _plain_storage(tensor) and tensor.untyped_storage().data_ptr() in storages


def _plain_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a strided view of a storage that holds its data as it is."""
    return tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_meta


def refusal(exc: BaseException) -> str:
    """Why torch.load(weights_only=True) refused, without torch's advice to turn it off.

    torch's message suggests loading with weights_only=False, which would run whatever the
    payload holds; keep only the sentences that say what was refused.
    """
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:  # its reason follows, on the same line or after blank ones
        kept = text.split(marker, 1)[1].strip().split("\n", 1)[:1]
    else:
        kept = [
            line
            for line in text.splitlines()
            if line.strip() and "weights_only" not in line.lower().replace(" ", "_")
        ]
    return f"{type(exc).__name__}: {' '.join(k.strip() for k in kept) or 'refused'}"


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Load bytes made by `encode`: JSON, or weights_only with every tensor on the CPU."""
    if bytes(data[:1]) == _JSON:
        return json.loads(bytes(data[1:]))
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _tensors_in(value: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    """The tensors in `value`: in containers and objects' attributes, each looked at once."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if isinstance(value, (str, bytes, int, float)) or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        items: Any = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        items = getattr(value, "__dict__", {}).values()
    for item in items:
        yield from _tensors_in(item, seen)


def _plain(value: Any, depth: int) -> bool:
    """Whether JSON gives back exactly `value`, types included (not a tuple, not a subclass)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return True
    if depth >= _MAX_DEPTH:
        return False
    if kind is list:
        return all(_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return False
