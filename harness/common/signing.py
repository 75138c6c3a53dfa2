"""Values the harness writes in a store something else can reach: signed with a session secret.

A TCPStore authenticates no client, so any local user who finds its port can read and write
keys. The harness's own keys are named and signed with a secret the session makes (warm
ranks get it over their private pipe; under torchrun the user provides one): another process
can neither guess the keys' names nor write a value that passes the check, and a value that
fails it is ignored and reported, never believed. Imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

_TAG_HEX = 16  # of a key's name: unguessable without the secret
_MAC_HEX = 64  # sha256


def new_secret() -> bytes:
    """A random secret for one session."""
    return secrets.token_bytes(32)


def key(secret: bytes | None, name: str) -> str:
    """`name` as a store key: with a tag only the secret's holders can compute (as it is,
    without a secret)."""
    if secret is None:
        return name
    tag = hmac.new(secret, b"key\0" + name.encode(), hashlib.sha256).hexdigest()[:_TAG_HEX]
    return f"{name}/{tag}"


def sign(secret: bytes | None, where: str, value: bytes | str) -> bytes:
    """`value` with its signature for the key `where` (as it is, without a secret)."""
    data = value.encode() if isinstance(value, str) else value
    if secret is None:
        return data
    return _mac(secret, where, data).encode() + b":" + data


def verify(secret: bytes | None, where: str, blob: bytes) -> bytes | None:
    """The value a signed `blob` under `where` holds; None if its signature does not hold."""
    if secret is None:
        return blob
    mac, sep, data = blob.partition(b":")
    if not sep or len(mac) != _MAC_HEX:
        return None
    expected = _mac(secret, where, data).encode()
    return data if hmac.compare_digest(mac, expected) else None


def _mac(secret: bytes, where: str, data: bytes) -> str:
    message = where.encode() + b"\0" + data
    return hmac.new(secret, message, hashlib.sha256).hexdigest()
