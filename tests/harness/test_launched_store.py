"""Signed values under torchrun are fresh: a value recorded from an earlier job with the same
run id and secret (which anyone reaching torchrun's store can list and read) is never read
in a later one. Each job's keys go under a prefix made from every rank's random word."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from harness.common import loopback
from harness.common.launch_detect import Launch
from harness.launched import store as store_module
from harness.launched import store_calls
from harness.launched.store import Peers
from harness.launched.store_calls import StoreCalls

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
            found = mine.gather("backend", f"gloo {mine.nonce}", 30.0, set())
            assert found.complete, found.absent
            if freshen:
                mine.freshen([(b or b"").split(b" ")[-1] for b in found.values])
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


@pytest.mark.parametrize("secret", [SECRET, None], ids=["signed", "unsigned"])
def test_a_second_job_on_the_same_store_is_told_and_the_first_goes_on(
    secret: bytes | None,
) -> None:
    """Two jobs whose launch blocks gave the same port meet in the first one's store: the
    second stops at once saying so (it would fail when the first job ends), the first goes
    on, and a restart of the first (the same run id) is still its own."""
    store = loopback.store()
    first = Peers(_launch(store.port, 0), 30.0, secret)
    other = Launch(2, 0, 0, 2, loopback.HOST, store.port, True, "another-run-id/0")
    with pytest.raises(store_module.ForeignStore, match="another job's") as info:
        Peers(other, 30.0, secret)
    assert f"{loopback.HOST}:{store.port}" in str(info.value)
    assert "give each job its own port" in str(info.value)
    restarted = Launch(2, 1, 1, 2, loopback.HOST, store.port, True, "a-fixed-run-id/1")
    Peers(restarted, 30.0, secret)  # no error: the same job
    first.put("at/0", "1")
    assert first.read("at/0") == b"1"


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


STORE_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


def _store_elsewhere() -> tuple[subprocess.Popen[str], int]:
    """A store in a process of its own (the node that holds it), and its port."""
    server = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    return server, int(server.stdout.readline())


def _stop(server: subprocess.Popen[str]) -> None:
    server.kill()
    server.wait()
    if server.stdout is not None:
        server.stdout.close()


def test_a_store_that_goes_away_is_lost_and_nothing_waits_on_it(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The node of rank 0 and the store lost: every store call failed with torch's
    DistNetworkError (an INTERNALERROR with C++ frames, four times). The store is marked lost
    with torch's first line, and from then a write is dropped, a read finds nothing, and a
    gather finds every other rank absent for that reason, at once. The call that found it
    gone printed nothing: torch logs such a failure as a C++ warning with its frames, which
    reached a rank's log uncut where it came between tests (the cluster lane's killed store
    node, now and then)."""
    server, port = _store_elsewhere()
    try:
        peers = Peers(_launch(port, 1), 30.0, None)
        peers.put("at/1", "0")
        assert peers.read("at/1") == b"0" and not peers.lost
        _stop(server)
        peers.put("at/1", "2")  # no error (a write may go out before the reset comes back)
        assert not peers.has("at/1")  # nor here: the store is lost
        assert peers.lost.startswith("DistNetworkError: ") and "\n" not in peers.lost
        assert "frame #" not in peers.lost
        started = time.monotonic()
        found = peers.gather("t0/outcome", "mine", 300.0, set())
        assert time.monotonic() - started < 5.0  # no wait on a store that is gone
        assert found.values == [None, None]
        assert found.absent == {0: f"the launch's store stopped answering ({peers.lost})"}
        assert peers.read("at/1") is None and not peers.has("at/1")
    finally:
        _stop(server)
    said = capfd.readouterr().err
    assert "[c10d]" not in said and "frame #" not in said, said


@pytest.mark.parametrize("mode", ["connection cut", "call left behind"])
def test_a_store_that_stops_answering_is_lost_after_the_bound(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], mode: str
) -> None:
    """Through a cut link no error comes: torch's call blocks until TCP gives up (about 15
    minutes), its own timeout notwithstanding. A call unanswered for STORE_ANSWER_S (1 s
    here, 30 s by default) marks the store lost: the client's connection is cut under it (the
    call fails at once), or, where that connection cannot be found, the call runs on a thread
    of its own and is left behind there. A cut prints nothing."""
    monkeypatch.setattr(store_module, "STORE_ANSWER_S", 1.0)
    if mode == "call left behind":
        monkeypatch.setattr(store_calls, "connection_to", lambda port, among: None)
    server, port = _store_elsewhere()
    try:
        peers = Peers(_launch(port, 1), 30.0, None)
        assert (peers._calls._handed is None) == (mode == "connection cut")
        peers.put("at/1", "0")
        os.kill(server.pid, signal.SIGSTOP)  # the store's node no longer answers
        _await_stopped(server.pid)
        started = time.monotonic()
        assert not peers.has("at/1")
        assert time.monotonic() - started < 10.0
        assert peers.lost == ("no answer within 1 s: the link to its node, or the node, is down")
        peers.put("at/1", "1")  # returns at once: the store is lost
        assert time.monotonic() - started < 10.0
    finally:
        _stop(server)
    # A call left behind fails once the store's process is gone: let it end inside this test
    # (calls handed to a thread run one at a time, so this one waits for it).
    assert peers._calls.run(lambda: None, 30.0) == (True, None)
    said = capfd.readouterr().err  # (one left behind is no longer held back as it fails)
    if mode == "connection cut":
        assert "[c10d]" not in said and "frame #" not in said, said


def _await_stopped(pid: int) -> None:
    """Until every thread of `pid` is stopped (a signal is delivered as each runs next)."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        if all(_state(task / "stat") in "tT" for task in tasks):
            return
        time.sleep(0.01)  # a poll of the state, not a wait in its place
    raise AssertionError(f"process {pid} did not stop within 30 s")


def _state(stat: Path) -> str:
    """A thread's state letter, from its /proc stat line (after the command's parenthesis)."""
    fields = stat.read_text().rpartition(")")[2].split()
    return fields[0] if fields else "?"


def test_calls_on_a_connection_are_bounded_by_cutting_it_and_keep_their_errors() -> None:
    """A call blocked reading the connection (a frozen store) ends when the watchdog shuts
    the connection down at its bound; calls before it are answered as they ended."""
    mine, theirs = socket.socketpair()
    try:
        calls = StoreCalls(mine.fileno())
        assert calls.run(lambda: 7, 5.0) == (True, 7)
        answered, error = calls.run(lambda: int("x"), 5.0)
        assert answered and isinstance(error, ValueError)
        started = time.monotonic()
        assert calls.run(lambda: mine.recv(1), 0.2) == (False, None)
        assert time.monotonic() - started < 5.0
        assert mine.recv(1) == b""  # cut: every later call fails at once
    finally:
        mine.close()
        theirs.close()


def test_calls_handed_to_a_thread_are_bounded_and_keep_their_errors() -> None:
    calls = StoreCalls(None)
    assert calls.run(lambda: 7, 5.0) == (True, 7)
    answered, error = calls.run(lambda: int("x"), 5.0)
    assert answered and isinstance(error, ValueError)
    blocked = threading.Event()
    assert calls.run(lambda: blocked.wait(60), 0.2) == (False, None)
    blocked.set()


def test_the_clients_connection_is_the_one_reaching_the_stores_port() -> None:
    """Found among the sockets the client opened: the one whose peer is the store's port;
    none where no socket, or more than one, is."""
    server = loopback.store()
    before = store_calls.socket_descriptors()
    client = dist.TCPStore(loopback.HOST, server.port, None, False)  # type: ignore[attr-defined]
    new = store_calls.socket_descriptors() - before
    found = store_calls.connection_to(server.port, new)
    assert found is not None and found in new
    assert store_calls.connection_to(server.port, set()) is None
    assert store_calls.connection_to(server.port + 1, new) is None
    client.set("k", "v")  # still in use: only looked at


@pytest.mark.parametrize("world", [2, 8])
def test_a_gather_costs_each_rank_the_same_store_calls_whatever_the_world(world: int) -> None:
    """Every rank read every rank's key and heartbeat one call at a time: 7 calls a rank at 2
    ranks, 25 at 8, per exchange, four exchanges a test. Where every value is there, a gather is
    this rank's write, one check and one read of every value together, at any world size."""
    server, port = _store_elsewhere()
    try:
        peers = [
            Peers(Launch(world, r, r, world, loopback.HOST, port, True, "run/0"), 30.0, SECRET)
            for r in range(world)
        ]
        for mine in peers:
            mine.put(f"x/{mine.rank}", f"value {mine.rank}")
        for mine in peers:  # a write is not answered: a read on its connection follows it
            assert mine.has(f"x/{mine.rank}")
        for mine in peers:
            calls: list[int] = []
            answered = mine._answered

            def counted(
                operation: Any, undone: Any, answered: Any = answered, calls: list[int] = calls
            ) -> Any:
                calls.append(1)
                return answered(operation, undone)

            mine._answered = counted  # type: ignore[method-assign]
            found = mine.gather("x", f"value {mine.rank}", 30.0, set())
            said = (mine.rank, len(calls), found, mine.lost, mine.refused)  # if it fails, why
            assert found.values == [f"value {r}".encode() for r in range(world)], said
            assert found.complete and len(calls) == 3, said
    finally:
        _stop(server)


def test_keys_set_with_a_gathers_value_cost_no_call_and_are_set_first() -> None:
    """A rank's place, said as it publishes its outcome: one operation sets both (the place
    first), so a gather still costs three calls, and a peer sees them together."""
    server, port = _store_elsewhere()
    try:
        mine, peer = (Peers(_launch(port, r), 30.0, SECRET) for r in (0, 1))
        peer.put("x/1", "theirs")
        calls: list[int] = []
        answered = mine._answered

        def counted(operation: Any, undone: Any) -> Any:
            calls.append(1)
            return answered(operation, undone)

        mine._answered = counted  # type: ignore[method-assign]
        found = mine.gather("x", "mine", 30.0, set(), [("at/0", "5")])
        assert found.values == [b"mine", b"theirs"] and len(calls) == 3
        assert peer.read("at/0") == b"5" and peer.read("x/0") == b"mine"
        mine.put_many([("a/0", "first"), ("b/0", b"\xff\x00 second")])
        assert peer.read("a/0") == b"first" and peer.read("b/0") == b"\xff\x00 second"
    finally:
        _stop(server)


def test_a_one_second_gather_says_a_peer_moved_on() -> None:
    """A rank whose test failed gathers in one-second turns: a peer already past the test is
    named as moved on (ranks out of step), not as late."""
    server, port = _store_elsewhere()
    try:
        ahead, behind = (Peers(_launch(port, r), 30.0, None) for r in (0, 1))
        ahead.put("at/0", "7")
        behind.follow(lambda: 3, lambda at: f"stage {at}", 0.0)
        found = behind.gather("t3/teardown", "mine", 1.0, set())
        assert found.absent == {0: "it had moved on to stage 7 (ranks out of step)"}
    finally:
        _stop(server)


def test_dropped_keys_go_with_the_next_flush_not_on_the_callers_way() -> None:
    """A test's keys, once every rank read them, are deleted by the heartbeat's thread: the
    drop itself sends nothing, and the flush deletes each (a call bounded as any other)."""
    server, port = _store_elsewhere()
    try:
        peers = Peers(_launch(port, 0), 30.0, SECRET)
        peers.put("t0/outcome/0", "mine")
        peers.put("t0/setup/0", "")
        peers.drop(["t0/outcome/0", "t0/setup/0"])
        assert peers.has("t0/outcome/0") and peers.has("t0/setup/0")
        peers.flush_drops()
        assert not peers.has("t0/outcome/0") and not peers.has("t0/setup/0")
        peers.flush_drops()  # nothing left: nothing sent
    finally:
        _stop(server)


def test_a_wait_in_the_store_ends_as_its_keys_arrive_or_at_its_slice_silently(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """An exchange waits in the store a slice at a time: a slice that ends with a key still
    missing is no error (torch raises, and logs its C++ frames, at a wait's timeout), a key
    set meanwhile ends the wait, and a store gone is lost."""
    server, port = _store_elsewhere()
    try:
        peers = Peers(_launch(port, 1), 30.0, None)
        names = [peers._name("x/0")]
        assert not peers._arrived(names, 0.05) and not peers.lost
        peers.put("x/0", "here")
        assert peers._arrived(names, 30.0) and peers._arrived(names, 0.0)
        _stop(server)
        assert not peers._arrived([peers._name("x/1")], 30.0)
        assert peers.lost.startswith("DistNetworkError")
    finally:
        _stop(server)
    said = capfd.readouterr().err
    assert "[c10d]" not in said and "frame #" not in said, said


def test_the_watchdog_ends_with_its_client() -> None:
    """One watchdog thread per client, for as long as the client is used: a session's Peers,
    or a test's, leaves no thread looking at a connection no one calls on."""
    mine, theirs = socket.socketpair()
    try:
        before = {t for t in threading.enumerate() if t.name == "harness-store-watch"}
        calls: StoreCalls | None = StoreCalls(mine.fileno())
        [watch] = {t for t in threading.enumerate() if t.name == "harness-store-watch"} - before
        del calls
        gc.collect()
        watch.join(30)
        assert not watch.is_alive()
    finally:
        mine.close()
        theirs.close()
