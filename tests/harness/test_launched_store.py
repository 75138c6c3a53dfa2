"""Signed values under torchrun are fresh: a value recorded from an earlier job with the same
run id and secret (which anyone reaching torchrun's store can list and read) is never read
in a later one. Each job's keys go under a prefix made from every rank's random word."""

from __future__ import annotations

import threading
from typing import Any

from harness.common import loopback
from harness.common.launch_detect import Launch
from harness.launched.store import Peers

SECRET = b"a-secret-of-this-user-32-bytes!!"


def _launch(port: int, rank: int) -> Launch:
    return Launch(2, rank, rank, 2, loopback.HOST, port, True, "a-fixed-run-id/0")


def _job(port: int, freshen: bool) -> list[Peers]:
    """Both ranks of one job start as the session starts them (the first exchange, then a
    fresh prefix); returns their Peers."""
    peers: list[Any] = [None, None]
    failed: list[BaseException] = []

    def start(rank: int) -> None:
        try:
            mine = Peers(_launch(port, rank), 30.0, SECRET)
            found, absent = mine.gather("backend", f"gloo {mine.nonce}", 30.0, set())
            assert not absent, absent
            if freshen:
                mine.freshen([(b or b"").split(b" ")[-1] for b in found])
            peers[rank] = mine
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=start, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failed, failed
    return peers


def _replayed_outcome_read(freshen: bool) -> bytes | None:
    """What rank 0 of a second job reads as rank 1's outcome when every key and value of
    the first job (where rank 1 had published one) was written into the second's store."""
    first = loopback.store()
    peers = _job(first.port, freshen)
    peers[1].put("t0/outcome/1", '{"recorded": "from the first job"}')
    # All but the count of arrivals, so that the second job's ranks take the same prefix.
    recorded = {k: first.get(k) for k in first.list_keys() if not k.endswith("/arrivals")}
    second = loopback.store()
    for key, value in recorded.items():
        second.set(key, value)
    later = _job(second.port, freshen)
    return later[0].read("t0/outcome/1")


def test_a_value_replayed_from_an_earlier_job_is_not_read() -> None:
    assert _replayed_outcome_read(freshen=True) is None


def test_without_a_fresh_prefix_the_replay_would_be_read() -> None:
    """The attack is real: with the first exchange's prefix alone, it is read."""
    assert _replayed_outcome_read(freshen=False) is not None
