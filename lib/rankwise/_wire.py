"""The one wire format for values: JSON for plain values, else torch.save bytes that must
load back with weights_only.

Plain values (None, bool, int, float, str, and lists and str-keyed dicts of them, exactly
those types) travel as JSON behind a one-byte tag: no pickle and no torch.load, so small
values cost what torch's object collectives cost. Anything else (tensors, tuples, other
keys) is torch.save bytes and counts as sendable only if it loads back with
``weights_only=True`` on the rank that produced it, so a value the receivers could not load
fails where it was made, before any rank waits for it. Loading never runs arbitrary code.
Tensors that use only part of their storage (one row of a large tensor) travel over a copy
of the span they use: views whose spans overlap share one storage on arrival, as torch.save
keeps them (a column of a matrix travels as a copy of its own elements). Tensor subclasses
(DTensor) travel as torch.save carries them. The sender's check builds no tensor data: it
loads onto the meta device.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import pickle
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rankwise._carried import Carried, CarriedError, from_data, to_data

_REGISTER_HINT = (
    "return plain values (tensors, numbers, strings, lists, tuples, dicts), or register the "
    "class on every rank with torch.serialization.add_safe_globals([YourClass]) before the call"
)


class WireError(TypeError):
    """A value cannot travel between ranks in rankwise's wire format."""


_JSON = b"J"  # torch.save's zip output starts with b"PK": the tags never collide
CARRIED = b"C"  # torch.save bytes holding Carried records (see _carried.py), to rebuild
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
    try:
        value, carried = to_data(value)  # defaultdicts, Counters, deques: as data
    except CarriedError as exc:
        raise WireError(f"{what}: {exc}") from None
    tensors = list(_tensors_in(value, set()))
    if any(t.is_meta for t in tensors):
        raise WireError(
            f"{what}: a tensor on the meta device has no data to send; materialize it first "
            f"(load its weights, or to_empty()), or send its shape and dtype instead"
        )
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer, pickle_module=_compacting(_Compaction.of(tensors)))
    except Exception as exc:
        raise WireError(
            f"{what}: the value of type {type(value).__name__} cannot be saved with "
            f"torch.save ({type(exc).__name__}: {exc}); {_REGISTER_HINT}"
        ) from exc
    data = buffer.getvalue()
    del buffer
    try:
        _check_loads(data, carried)
    except Exception as exc:
        raise WireError(
            f"{what}: the value of type {type(value).__name__} does not load back with "
            f"torch.load(weights_only=True) ({refusal(exc)}); {_hint_for(value)}"
        ) from None  # torch's own text advises weights_only=False: never pass that on
    return CARRIED + data if carried else data


def _check_loads(data: bytes, carried: bool = False) -> None:
    """Raise what torch.load(weights_only=True) would raise for `data`, without building a
    second copy of every tensor: the storages are made on the meta device, so the check
    reads the pickle and none of the data. A value that loads only where its data is real
    (a rebuild function that reads it) gets the full check before it is refused."""
    try:
        with _loading(carried):
            torch.load(io.BytesIO(data), weights_only=True, map_location="meta")
    except Exception:
        decode(CARRIED + data if carried else data)


def _hint_for(value: Any) -> str:
    """What to do about a value weights_only refused: for a known container that does not
    load, what to send instead; else register the class."""
    for kind, instead in _REPLACEMENTS:
        if _holds(value, kind, set(), 0):
            return (
                f"it holds a {kind.__name__}, which weights_only does not load: send "
                f"{instead} instead"
            )
    return _REGISTER_HINT


# Containers that weights_only refuses, and what to send in their place.
_REPLACEMENTS = (
    (collections.defaultdict, "a plain dict (dict(value))"),
    (collections.Counter, "a plain dict (dict(value))"),
    (collections.deque, "a list (list(value))"),
)


def _holds(value: Any, kind: type, seen: set[int], depth: int) -> bool:
    if isinstance(value, kind):
        return True
    if depth >= _MAX_DEPTH or id(value) in seen or isinstance(value, (str, bytes)):
        return False
    seen.add(id(value))
    return any(_holds(item, kind, seen, depth + 1) for item in _members(value, False))


def _members(value: Any, attributes: bool) -> Any:
    """What `value` holds: a dict's keys and values, a sequence's or a set's items, else
    (with `attributes`) the values of its attributes; nothing for anything else."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    return getattr(value, "__dict__", {}).values() if attributes else ()


@dataclass
class _Compaction:
    """How the tensors here that use only part of their storage travel: torch.save keeps a
    view's whole storage, so one row of a large tensor would send all of it.

    Per storage, views whose byte spans overlap form one cluster, which travels over one copy
    of the span it covers: views that share elements still share a storage on arrival. A
    view that reads few of the bytes it spans (a column of a matrix) travels as a copy of
    its own elements instead of stretching its cluster's span over the whole storage. A
    storage is compacted only where that sends fewer bytes than the storage itself, and only
    where every tensor of it here is a plain strided tensor (not a parameter, subclass or a
    conj/neg view, which torch.save rebuilds in ways of its own).
    """

    spans: dict[int, tuple[int, int]]  # tensor id -> its cluster's (first byte, end byte)
    own: set[int]  # ids of the tensors that travel as copies of their own elements
    made: dict[tuple[int, int], torch.UntypedStorage]  # compact storages by (address, first)

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> _Compaction:
        by_storage: dict[int, list[torch.Tensor]] = {}
        refused: set[int] = set()
        for tensor in tensors:
            address = _storage_address(tensor)
            if address is None:
                continue
            by_storage.setdefault(address, []).append(tensor)
            if not _plain_storage(tensor):
                refused.add(address)
        plan = cls({}, set(), {})
        for address, views in by_storage.items():
            if address not in refused:
                plan._add(views, views[0].untyped_storage().nbytes())
        return plan

    def _add(self, views: list[torch.Tensor], storage_bytes: int) -> None:
        """Plan one storage's views, if compacting them sends fewer bytes than it holds."""
        spans: dict[int, tuple[int, int]] = {}
        own: set[int] = set()
        sent = 0
        dense = []
        for view in views:
            if view.numel() == 0:
                own.add(id(view))
                continue
            first, end = _byte_span(view)
            if end - first > 2 * view.numel() * view.element_size():
                own.add(id(view))
                sent += view.numel() * view.element_size()
            else:
                dense.append((first, end, view))
        for cluster in _clusters(dense):
            first = min(f for f, _, _ in cluster)
            first -= first % max(v.element_size() for _, _, v in cluster)
            end = max(e for _, e, _ in cluster)
            sent += end - first
            spans.update({id(v): (first, end) for _, _, v in cluster})
        if sent < storage_bytes:
            self.spans.update(spans)
            self.own.update(own)

    def rebuilt(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`tensor` as it travels, or None where it travels as it is."""
        if id(tensor) in self.own:
            copy = tensor.detach().clone()
        elif id(tensor) in self.spans:
            copy = self._over_span(tensor, *self.spans[id(tensor)])
        else:
            return None
        copy.requires_grad_(tensor.requires_grad)
        copy.__dict__.update(tensor.__dict__)  # attributes set on the tensor travel too
        return copy

    def _over_span(self, tensor: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """`tensor` over a copy of bytes first..end of its storage, made once per cluster."""
        key = (tensor.untyped_storage().data_ptr(), first)
        storage = self.made.get(key)
        if storage is None:
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            whole.set_(tensor.untyped_storage())
            storage = self.made[key] = whole[first:end].clone().untyped_storage()
        size = tensor.element_size()
        offset = (tensor.storage_offset() * size - first) // size
        copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return copy.set_(storage, offset, tensor.size(), tensor.stride())


def _clusters(
    spans: list[tuple[int, int, torch.Tensor]],
) -> list[list[tuple[int, int, torch.Tensor]]]:
    """The spans grouped where they overlap (sorted by their first byte)."""
    clusters: list[list[tuple[int, int, torch.Tensor]]] = []
    reach = 0  # one past the last byte of the cluster being built
    for span in sorted(spans, key=lambda s: (s[0], s[1])):
        if clusters and span[0] < reach:
            clusters[-1].append(span)
            reach = max(reach, span[1])
        else:
            clusters.append([span])
            reach = span[1]
    return clusters


def _compacting(compaction: _Compaction) -> Any:
    """What torch.save needs of a pickle module, with a pickler that saves each tensor of
    `compaction` over its compact storage (plain pickle where there is none)."""
    if not (compaction.spans or compaction.own):
        return pickle

    class CompactPickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            copy = compaction.rebuilt(obj) if type(obj) is torch.Tensor else None
            if copy is None:
                return NotImplemented
            return copy.__reduce_ex__(torch.serialization.DEFAULT_PROTOCOL)  # type: ignore[no-untyped-call]

    class Compacting:
        Pickler = CompactPickler
        Unpickler = pickle.Unpickler

    return Compacting


def _storage_address(tensor: torch.Tensor) -> int | None:
    """The address of the storage `tensor` holds its data in; None for a tensor without one
    of its own (a wrapper subclass such as DTensor, a nested or sparse tensor)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return None
    if tensor.is_nested or tensor.is_quantized or tensor.is_meta:
        return None
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):  # a storage torch cannot show
        return None


def _plain_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` can be rebuilt over a copy of part of its storage as it is."""
    return type(tensor) is torch.Tensor and not (tensor.is_conj() or tensor.is_neg())


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The first byte of its storage a non-empty strided tensor reads, and one past its last."""
    size = tensor.element_size()
    last = sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride(), strict=True))
    first = int(tensor.storage_offset()) * size
    return first, first + int(last + 1) * size


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


def decode_many(blobs: list[bytes]) -> list[Any]:
    """`decode` of each blob, in order. Where every one is a JSON number, bool or null (a
    large group's all_reduce of counts decodes one per member), all are read in one parse:
    such a token holds no comma or bracket, so joined with commas each stays one value."""
    joined = b"\n".join(blobs) + b"\n"
    if blobs and joined.count(b"\n") == len(blobs) and _SCALARS.fullmatch(joined):
        values = json.loads(b"[" + b",".join(blob[1:] for blob in blobs) + b"]")
        return values  # type: ignore[no-any-return]
    return [decode(blob) for blob in blobs]


# Blobs joined by newlines, each one JSON scalar (a blob holding a newline is caught by the
# count, and then each is decoded on its own).
_SCALARS = re.compile(
    rb"(?:J(?:-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null|NaN|-?Infinity)\n)+"
)


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Load bytes made by `encode`: JSON, or weights_only with every tensor on the CPU (and
    the containers carried as data rebuilt: WireError for a record no encoder wrote)."""
    tag = bytes(data[:1])
    if tag == _JSON:  # encode wrote UTF-8: decoded as that, not sniffed as json.loads does
        return json.loads(bytes(data[1:]).decode("utf-8", "surrogatepass"))
    if tag != CARRIED:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    with _loading(carried=True):
        loaded = torch.load(io.BytesIO(bytes(data[1:])), weights_only=True, map_location="cpu")
    try:
        return from_data(loaded)
    except CarriedError as exc:
        raise WireError(str(exc)) from None


def _loading(carried: bool) -> Any:
    """weights_only's load, allowing the one class of carried records where there are any:
    its instances hold data and run nothing (see _carried.py)."""
    if not carried:
        return contextlib.nullcontext()
    return torch.serialization.safe_globals([Carried])


def _tensors_in(value: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    """The tensors in `value`: in containers and objects' attributes, each looked at once."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if isinstance(value, (str, bytes, int, float)) or id(value) in seen:
        return
    seen.add(id(value))
    for item in _members(value, True):
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
