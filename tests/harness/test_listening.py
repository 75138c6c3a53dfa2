"""The bounded wait for a TCP listener (harness/common/listening.py): it ends as the listener
takes a connection, or with the last refusal once its bound has passed."""

from __future__ import annotations

import socket

import pytest

from harness.common import listening

pytestmark = pytest.mark.unit

_PAUSES = {"first_pause_s": 0.001, "last_pause_s": 0.05, "try_at_least_s": 0.1}


def test_a_listener_ends_the_wait() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert listening.await_listening("127.0.0.1", port, 30.0, **_PAUSES) is None


def test_no_listener_gives_the_last_refusal_past_the_bound() -> None:
    with socket.socket() as unopened:
        unopened.bind(("127.0.0.1", 0))  # bound, never listening: every try refused
        port = unopened.getsockname()[1]
        failed = listening.await_listening("127.0.0.1", port, 0.2, **_PAUSES)
    assert isinstance(failed, ConnectionRefusedError)
