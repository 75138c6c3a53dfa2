"""Containers callers send that torch.load(weights_only=True) cannot rebuild, carried as data.

modelopt's auto-quantize search syncs a recipe's format that holds a ``defaultdict(dict)``;
``weights_only`` refuses a defaultdict (and a Counter, a deque). Before torch.save each of
them becomes a :class:`Carried` record (its kind, its default factory named, its items),
and after loading the record becomes the same container again. Loading runs no code: the
record's class is the one global the load allows beyond weights_only's own, and a factory
is looked up by name in a fixed table of builtin types (a payload naming anything else,
written by hand, is refused). An OrderedDict needs none of this: weights_only loads it.
"""

from __future__ import annotations

import collections
from typing import Any

# The default factories a carried defaultdict may have, by name: builtin types, whose call
# (a missing key's default) runs no code of anyone's.
FACTORIES: dict[str | None, Any] = {
    None: None,
    "dict": dict,
    "list": list,
    "set": set,
    "int": int,
    "float": float,
    "str": str,
    "tuple": tuple,
}
_NAMES = {id(factory): name for name, factory in FACTORIES.items() if factory is not None}
SHOWN_FACTORIES = "dict, list, set, int, float, str, tuple or None"
_MAX_DEPTH = 32


class CarriedError(TypeError):
    """A container the wire does not carry (a defaultdict of another factory), or a record
    no encoder wrote."""


class Carried:
    """A defaultdict, Counter or deque as data: its kind, its default factory's name (a
    defaultdict's) and its items ([key, value] pairs for the dicts)."""

    def __init__(
        self, kind: str, factory: str | None, items: list[Any], maxlen: int | None = None
    ) -> None:
        self.kind, self.factory, self.items, self.maxlen = kind, factory, items, maxlen

    def __reduce__(self) -> tuple[Any, ...]:
        return (Carried, (self.kind, self.factory, self.items, self.maxlen))


def to_data(value: Any, depth: int = 0) -> tuple[Any, bool]:
    """`value` with each defaultdict, Counter and deque in its dicts, lists and tuples made a
    record, and whether any was (the same object when none was: nothing is copied)."""
    if depth >= _MAX_DEPTH:
        return value, False
    kind = type(value)
    if kind is collections.defaultdict:
        return _record_of_defaultdict(value, depth), True
    if kind is collections.Counter:
        return Carried("Counter", None, [[k, v] for k, v in value.items()]), True
    if kind is collections.deque:
        items = [to_data(item, depth + 1)[0] for item in value]
        return Carried("deque", None, items, value.maxlen), True
    if kind in (dict, collections.OrderedDict):
        found = {k: to_data(v, depth + 1) for k, v in value.items()}
        if not any(changed for _, changed in found.values()):
            return value, False
        return kind((k, v) for k, (v, _) in found.items()), True
    if kind in (list, tuple):
        items = [to_data(item, depth + 1) for item in value]
        if not any(changed for _, changed in items):
            return value, False
        return kind(item for item, _ in items), True
    return value, False


def _record_of_defaultdict(value: collections.defaultdict[Any, Any], depth: int) -> Carried:
    factory = value.default_factory
    if factory is not None and id(factory) not in _NAMES:
        shown = getattr(factory, "__qualname__", None) or repr(factory)
        raise CarriedError(
            f"a defaultdict whose default_factory is {shown} cannot travel (the wire carries "
            f"a defaultdict whose default_factory is {SHOWN_FACTORIES}): send dict(value), "
            f"or make its factory one of those"
        )
    items = [[k, to_data(v, depth + 1)[0]] for k, v in value.items()]
    return Carried("defaultdict", None if factory is None else _NAMES[id(factory)], items)


def from_data(value: Any, depth: int = 0) -> Any:
    """What `to_data` made, loaded back: each record the container it stands for."""
    if depth >= _MAX_DEPTH:
        return value
    kind = type(value)
    if kind is Carried:
        return _container_of(value, depth)
    if kind in (dict, collections.OrderedDict):
        return kind((k, from_data(v, depth + 1)) for k, v in value.items())
    if kind in (list, tuple):
        return kind(from_data(item, depth + 1) for item in value)
    return value


def _container_of(record: Carried, depth: int) -> Any:
    if record.kind == "defaultdict":
        if record.factory not in FACTORIES:
            raise CarriedError(
                f"a defaultdict record names the default_factory {record.factory!r}, not one "
                f"the wire carries ({SHOWN_FACTORIES}): refused, nothing in it was run (the "
                f"payload was not written by rankwise)"
            )
        pairs = [(k, from_data(v, depth + 1)) for k, v in record.items]
        return collections.defaultdict(FACTORIES[record.factory], pairs)
    if record.kind == "Counter":
        return collections.Counter({k: v for k, v in record.items})
    if record.kind == "deque":
        items = [from_data(item, depth + 1) for item in record.items]
        return collections.deque(items, record.maxlen)
    raise CarriedError(
        f"a record of kind {record.kind!r} is not one the wire carries: refused (the payload "
        f"was not written by rankwise)"
    )
