"""The one wire format for values: torch.save bytes that must load back with weights_only.

A value counts as sendable only if it loads back with ``weights_only=True`` on the rank that
produced it, so a value the receivers could not load fails where it was made, before any rank
waits for it. Loading never runs arbitrary code: weights_only refuses what it does not know.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import torch

_REGISTER_HINT = (
    "return plain values (tensors, numbers, strings, lists, tuples, dicts), or register the "
    "class on every rank with torch.serialization.add_safe_globals([YourClass]) before the call"
)


class WireError(TypeError):
    """A value cannot travel between ranks in rankwise's wire format."""


def encode(value: Any, what: str) -> bytes:
    """torch.save `value` to bytes, checked to load back with weights_only=True."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
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
            f"torch.load(weights_only=True) ({type(exc).__name__}: {exc}); {_REGISTER_HINT}"
        ) from exc
    return data


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Load bytes made by `encode`: weights_only, every tensor on the CPU."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


@dataclass(frozen=True)
class Record:
    """What one rank contributes to a collective: its status, its label, and its payload."""

    kind: str  # "all_reduce", "broadcast_from", "gather_bytes", ...
    label: str
    status: str  # "ok", "error" or "exit"
    error: str = ""  # "ValueError: bad batch" when status is "error"
    code: int = 0  # the exit code when status is "exit"
    size: int = 0  # the length of the data that follows, for gathers
    payload: bytes = b""

    @property
    def call(self) -> str:
        return f"{self.kind}({self.label!r})"

    def to_bytes(self) -> bytes:
        header = json.dumps(
            {
                "kind": self.kind,
                "label": self.label,
                "status": self.status,
                "error": self.error,
                "code": self.code,
                "size": self.size,
            }
        ).encode()
        return len(header).to_bytes(4, "little") + header + self.payload

    @staticmethod
    def from_bytes(data: bytes) -> Record:
        size = int.from_bytes(data[:4], "little")
        header = json.loads(data[4 : 4 + size])
        return Record(payload=bytes(data[4 + size :]), **header)
