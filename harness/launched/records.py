"""A rank's outcome as it travels between launched ranks: JSON of a fixed schema, never pickle.

torchrun's store is reachable by anything that reaches its port, and its keys are predictable:
what a rank reads from it is data, checked field by field on arrival, so the worst a forged
value can do is a wrong verdict, which the report names. A test's return value travels in
rankwise's wire format (JSON when JSON gives it back exactly, else ``torch.save`` bytes that
load with ``weights_only=True``: tensors, tuples, ...); anything else is reported as not sent
back.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import pickle
from collections.abc import Callable
from typing import Any, cast

from rankwise import testing as wire

from harness.common.outcome import Ending, RankOutcome, RankWarning

# An identifier of the record, not a module path. 3: a field at its default is left out
# (every rank reads every peer's record after every test: a plain pass is five fields).
_SCHEMA = "harness.outcome/3"


class RecordError(ValueError):
    """A store value that is not a record the harness wrote."""


def encode_outcome(outcome: RankOutcome) -> str:
    """`outcome` as the JSON record a peer reads: its fields not at their defaults."""
    fields: dict[str, Any] = {
        "key": outcome.key, "rank": outcome.rank, "pid": outcome.pid,
        "ending": outcome.ending.value,
    }  # fmt: skip
    for name, default in _DEFAULTS.items():
        value = getattr(outcome, name)
        if value != default:
            fields[name] = value
    if "warnings" in fields:
        fields["warnings"] = [dataclasses.asdict(w) for w in outcome.warnings]
    if "leftovers" in fields:
        fields["leftovers"] = dict(outcome.leftovers)
    record: dict[str, Any] = {"schema": _SCHEMA, "fields": fields}
    if outcome.value_blob is not None:
        value, lost = _value_record_of(outcome.value_blob)
        if value is not None:
            record["value"] = value
        else:
            fields["value_lost"] = lost
    return json.dumps(record)


def decode_outcome(blob: bytes, key: str, rank: int) -> RankOutcome:
    """The outcome in `blob`, read under `key` for `rank`; RecordError for anything else."""
    try:
        return _decode_outcome(blob, key, rank)
    except RecordError:
        raise
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise RecordError(f"malformed ({type(exc).__name__}: {exc})") from None


def _decode_outcome(blob: bytes, key: str, rank: int) -> RankOutcome:
    if len(blob) > _MAX_RECORD_BYTES:
        raise RecordError(f"{len(blob)} bytes, more than a record may hold")
    try:
        record = json.loads(blob)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("schema") != _SCHEMA:
        raise RecordError("not an outcome record of this harness")
    fields = record.get("fields")
    if not isinstance(fields, dict):
        raise RecordError("its fields are missing")
    read: dict[str, Any] = {}
    for name in _REQUIRED:
        if name not in fields:
            raise RecordError(f"field {name!r} is missing")
    for name, check in _CHECKS.items():
        if name in fields:  # else its default, as the writer left it out
            read[name] = check(name, fields[name])
    said_rank = fields.get("rank")
    if type(said_rank) is not int or said_rank != rank or fields.get("key") != key:
        raise RecordError(f"it says it is rank {fields.get('rank')!r}'s of {fields.get('key')!r}")
    if "value" in record:
        read["value_blob"] = pickle.dumps(_value_from(record["value"]))  # a value of our own
    return RankOutcome(key=key, rank=rank, **read)


def _value_record_of(blob: bytes) -> tuple[dict[str, str] | None, str]:
    """_value_record of the value this rank pickled itself (its own, so loaded), or why not
    where its pickle does not load back (a __reduce__ that leaves out what __init__ needs)."""
    try:
        value = pickle.loads(blob)
    except Exception as exc:
        return None, f"its pickle does not load back ({type(exc).__name__}: {exc})"
    return _value_record(value)


def _value_record(value: Any) -> tuple[dict[str, str] | None, str]:
    """How a return value travels: ({"wire": base64 of rankwise's wire bytes}, "") or
    (None, why it cannot)."""
    try:
        data = wire.encode(value, "the return value")
    except wire.WireError as exc:
        return None, (
            f"between launched ranks a value travels as JSON or as what torch.load("
            f"weights_only=True) loads, never pickled ({exc})"
        )
    return {"wire": base64.b64encode(data).decode()}, ""


def _value_from(value: Any) -> Any:
    if not isinstance(value, dict) or set(value) != {"wire"} or not isinstance(value["wire"], str):
        raise RecordError("its value is malformed")
    try:
        data = base64.b64decode(value["wire"], validate=True)
    except binascii.Error:
        raise RecordError("its value is not base64") from None
    try:
        return wire.decode(data)
    except (ValueError, RecursionError):  # the JSON form
        raise RecordError("its value is not JSON") from None
    except Exception as exc:
        raise RecordError(
            f"its value does not load with weights_only ({wire.refusal(exc)})"
        ) from None


def _str(name: str, value: Any) -> str:
    return cast(str, _typed(name, value, str))


def _bool(name: str, value: Any) -> bool:
    return cast(bool, _typed(name, value, bool))


def _int_or_none(name: str, value: Any) -> int | None:
    return None if value is None else _int(name, value)


def _seconds(name: str, value: Any) -> float:
    return float(_typed(name, value, (int, float)))


def _ending(name: str, value: Any) -> Ending:
    try:
        return Ending(value)
    except ValueError:
        raise RecordError(f"field {name!r} is {value!r}") from None


def _string_tuple(name: str, value: Any) -> tuple[str, ...]:
    return tuple(_strings(name, value))


def _leftovers(name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise RecordError(f"field {name!r} is not an object")
    return {_typed(name, k, str): _typed(name, v, str) for k, v in value.items()}


def _warnings(name: str, value: Any) -> tuple[RankWarning, ...]:
    return tuple(_warning(w) for w in _typed(name, value, list))


def _skipped_at(name: str, value: Any) -> tuple[str, int] | None:
    if value is None:
        return None
    where = _typed(name, value, list)
    if len(where) != 2:
        raise RecordError(f"field {name!r} is not (file, line)")
    return (_typed(name, where[0], str), _int(name, where[1]))


def _typed(name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if type(value) is kind:  # nearly every value: no subclass, no bool standing for an int
        return value
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RecordError(f"field {name!r} is of type {type(value).__name__}")
    return value


def _int(name: str, value: Any) -> int:
    return int(_typed(name, value, int))


def _strings(name: str, value: Any) -> list[str]:
    return [_typed(name, item, str) for item in _typed(name, value, list)]


def _warning(value: Any) -> RankWarning:
    if not isinstance(value, dict) or set(value) != {"category", "message", "filename", "lineno"}:
        raise RecordError("a warning is malformed")
    return RankWarning(
        _typed("warnings", value["category"], str),
        _typed("warnings", value["message"], str),
        _typed("warnings", value["filename"], str),
        _int("warnings", value["lineno"]),
    )


# How each field is checked on arrival (tuples arrive as JSON lists), in the dataclass's
# order; built once, as every rank reads every peer's outcome after every test.
_BY_FIELD: dict[str, Callable[[str, Any], Any]] = {
    **dict.fromkeys(
        ("value_repr", "value_lost", "exc_type", "message", "traceback", "stack", "where",
         "stdout", "stderr", "log", "replace_after"),
        _str,
    ),
    **dict.fromkeys(("after_failure", "setup_failed"), _bool),
    **dict.fromkeys(("exit_code", "signal", "origin_rank"), _int_or_none),
    **dict.fromkeys(("pid", "setup_attempts"), _int),
    **dict.fromkeys(("exc_mro", "exc_classes", "notes"), _string_tuple),
    "at": _seconds, "ending": _ending, "leftovers": _leftovers, "warnings": _warnings,
    "skipped_at": _skipped_at,
}  # fmt: skip
_CHECKS = {  # key and rank are compared with what the reader expects; value_blob never travels
    f.name: _BY_FIELD[f.name]
    for f in dataclasses.fields(RankOutcome)
    if f.name not in ("value_blob", "key", "rank")
}
_REQUIRED = ("pid", "ending")  # the fields with no default: in every record
_DEFAULTS = {  # the rest, each left out of a record where it holds this
    f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    for f in dataclasses.fields(RankOutcome)
    if f.name in _CHECKS and f.name not in _REQUIRED
}


def read_json(blob: bytes, key: str, fields: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """The JSON object under `key` with each of `fields` present and of its type (a list's
    items strings, where strings are what it holds); RecordError otherwise (saying which key
    held what), so a forged or damaged value is named, never believed."""
    try:
        record = json.loads(blob)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RecordError(f"the value under {key!r} is not JSON") from None
    if not isinstance(record, dict):
        raise RecordError(f"the value under {key!r} is not a JSON object")
    for name, kind in fields.items():
        value = record.get(name)
        wrong = name not in record or not isinstance(value, kind)
        if wrong or (isinstance(value, bool) and bool not in _kinds(kind)):
            raise RecordError(f"the value under {key!r} has no {name!r} of the harness's")
        if name in _STRING_LISTS and not all(isinstance(item, str) for item in record[name]):
            raise RecordError(f"the value under {key!r} has a {name!r} not of strings")
    return record


# Fields read with read_json that hold lists of strings.
_STRING_LISTS = {"tests", "errors"}
_MAX_RECORD_BYTES = 64 * 1024 * 1024  # an outcome with its output tails and a value


def read_int(blob: bytes | None, key: str, default: int) -> int:
    """An int the harness wrote as text under `key`; `default` for anything else."""
    try:
        return int(blob.decode("ascii")) if blob is not None else default
    except (ValueError, UnicodeDecodeError):
        return default


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)
