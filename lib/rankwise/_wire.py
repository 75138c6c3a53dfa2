"""The one wire format for values: torch.save bytes that must load back with weights_only.

A value counts as sendable only if it loads back with ``weights_only=True`` on the rank that
produced it, so a value the receivers could not load fails where it was made, before any rank
waits for it. Loading never runs arbitrary code: weights_only refuses what it does not know.
"""

from __future__ import annotations

import io
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
            f"torch.load(weights_only=True) ({refusal(exc)}); {_REGISTER_HINT}"
        ) from None  # torch's own text advises weights_only=False: never pass that on
    return data


def refusal(exc: BaseException) -> str:
    """Why torch.load(weights_only=True) refused, without torch's advice to turn it off.

    torch's message suggests loading with weights_only=False, which would run whatever the
    payload holds; keep only the sentences that say what was refused.
    """
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        kept = [text.split(marker, 1)[1].split("\n", 1)[0]]
    else:
        kept = [
            line
            for line in text.splitlines()
            if line.strip() and "weights_only" not in line.lower().replace(" ", "_")
        ]
    return f"{type(exc).__name__}: {' '.join(k.strip() for k in kept) or 'refused'}"


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Load bytes made by `encode`: weights_only, every tensor on the CPU."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
