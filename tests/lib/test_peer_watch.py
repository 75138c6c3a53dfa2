"""rankwise's peer watch, without processes where it is logic: silence against a bound,
peers that left or never started, naming lost ranks and hosts, the setting."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import pytest
from rankwise import _watch


class FakeStore:
    """The store calls the watch makes, over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch_of(world: int, rank: int = 0, bound: float = 60.0) -> tuple[Any, FakeStore, Clock]:
    store, clock = FakeStore(), Clock()
    watch = _watch.Watch(store, rank, world, bound, bound / 10, clock=clock)
    watch.store_ok_at = clock.now
    for r in range(world):
        where = {"host": f"n{r // 2}", "pid": 1, "boot": "", "addresses": [f"10.0.0.{r // 2}"]}
        store.set(f"rankwise/watch/where/{r}", json.dumps(where))
    return watch, store, clock


def _beat(store: FakeStore, *ranks: int) -> None:
    for r in ranks:
        store.add(f"rankwise/watch/beat/{r}", 1)


@pytest.mark.unit
def test_a_peer_silent_past_the_bound_is_lost_and_named_with_its_host() -> None:
    watch, store, clock = _watch_of(4)
    _beat(store, 1, 2, 3)
    watch._read_peers()
    for _ in range(7):  # ten seconds apart: ranks 1 and 3 count, rank 2 is silent
        clock.now += 10
        _beat(store, 1, 3)
        watch._read_peers()
    assert watch.lost == (2,)
    assert watch.describe(watch.lost) == (
        "rank 2 (host n1) silent for 70 s (no heartbeat: frozen, cut off, or its node gone; "
        "the bound is 60 s, RANKWISE_PEER_TIMEOUT)"
    )


@pytest.mark.unit
def test_a_slow_peer_that_keeps_counting_is_never_lost() -> None:
    watch, store, clock = _watch_of(3, bound=5)
    for _ in range(100):  # 1000 s of a long computation: its watch thread still counts
        clock.now += 10
        _beat(store, 1, 2)
        watch._read_peers()
        assert watch.lost == ()


@pytest.mark.unit
def test_silence_is_judged_from_the_first_look_not_before() -> None:
    watch, store, clock = _watch_of(2, bound=60)
    _beat(store, 1)
    clock.now += 500  # nobody looked: a collective that finished quickly reads nothing
    watch._read_peers()
    assert watch.lost == ()
    clock.now += 59
    watch._read_peers()
    assert watch.lost == ()
    clock.now += 1
    watch._read_peers()
    assert watch.lost == (1,)


@pytest.mark.unit
def test_a_peer_whose_watch_never_started_is_not_judged() -> None:
    """Still on its way to its first labelled collective (however slowly): no count yet."""
    watch, store, clock = _watch_of(3)
    _beat(store, 1)
    watch._read_peers()
    clock.now += 600
    watch._read_peers()
    assert watch.lost == (1,)  # rank 2 never counted: not called lost


@pytest.mark.unit
def test_a_peer_that_left_is_not_lost() -> None:
    watch, store, clock = _watch_of(3, bound=10)
    _beat(store, 1, 2)
    watch._read_peers()
    store.set("rankwise/watch/left/1", "1")  # its run ended (or it found its own peers lost)
    clock.now += 20
    _beat(store, 2)
    watch._read_peers()
    assert watch.lost == ()


@pytest.mark.unit
def test_a_node_s_ranks_are_named_together() -> None:
    watch, store, clock = _watch_of(6, bound=10)
    _beat(store, 1, 2, 3, 4, 5)
    watch._read_peers()
    clock.now += 11
    _beat(store, 1, 2, 3)
    watch._read_peers()
    assert watch.lost == (4, 5)
    assert watch.describe(watch.lost).startswith("ranks 4, 5 (host n2) silent for 11 s")


@pytest.mark.unit
def test_gloo_s_peer_address_names_the_node_it_was() -> None:
    watch, _, _ = _watch_of(6)
    words = "[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:2782. ..."
    assert watch.explain_link_failure(words) == (
        "ranks 4, 5 (host n2) closed the connection (died, or its node went down)",
        (4, 5),
    )
    v6 = "Read error [::ffff:10.0.0.1]:41000: Connection reset by peer"
    assert watch.explain_link_failure(v6) is not None
    assert watch.explain_link_failure(v6)[1] == (2, 3)  # type: ignore[index]


@pytest.mark.unit
def test_an_address_every_rank_shares_names_nobody_by_address() -> None:
    watch, store, _ = _watch_of(4)
    for r in range(4):  # one machine: every rank on 127.0.0.1
        where = {"host": "vm", "pid": 1, "boot": "", "addresses": ["127.0.0.1"]}
        store.set(f"rankwise/watch/where/{r}", json.dumps(where))
    assert watch.explain_link_failure("Connection closed by peer [127.0.0.1]:5") is None


@pytest.mark.parametrize("fate", ["died", "frozen"])
def test_a_peer_on_this_machine_is_named_by_what_happened_to_its_process(fate: str) -> None:
    watch, store, _ = _watch_of(3)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
        for r, pid in ((0, os.getpid()), (1, os.getpid()), (2, peer.pid)):
            where = {"host": "vm", "pid": pid, "boot": boot, "addresses": ["127.0.0.1"]}
            store.set(f"rankwise/watch/where/{r}", json.dumps(where))
        if fate == "died":
            peer.kill()
            peer.wait(10)
        else:
            os.kill(peer.pid, signal.SIGSTOP)
        said, lost = watch.explain_link_failure("Connection reset by peer [127.0.0.1]:9")
    finally:
        peer.kill()
        peer.wait(10)
    assert lost == (2,)
    assert said == ("rank 2 (host vm) died (process gone)" if fate == "died" else
                    "rank 2 (host vm) frozen (stopped)")  # fmt: skip


def _ranks_2_and_3_silent() -> Any:
    """A watch of 4 ranks (bound 10 s) that has seen ranks 2 and 3 silent for 11 s."""
    watch, store, clock = _watch_of(4, bound=10)
    _beat(store, 1, 2, 3)
    watch._read_peers()
    clock.now += 11
    _beat(store, 1)
    watch._read_peers()
    return watch


@pytest.mark.unit
def test_known_silent_peers_explain_a_link_that_failed_after_them() -> None:
    watch = _ranks_2_and_3_silent()
    said, lost = watch.explain_link_failure("Connection closed by peer [10.0.0.0]:1")
    assert lost == (2, 3) and said.startswith("ranks 2, 3 (host n1) silent for 11 s")


def _rank_1_found_ranks_2_and_3_died() -> tuple[Any, FakeStore, Any]:
    """Rank 0's watch, and rank 1's over the same store after it found ranks 2 and 3 dead
    (gloo's closed connection) and said so; rank 0 itself waits on rank 1, hearing nothing."""
    watch, store, _ = _watch_of(4, bound=10)
    _beat(store, 1, 2, 3)
    watch._read_peers()
    finder = _watch.Watch(store, 1, 4, 10.0, 1.0)
    finder.found = "ranks 2, 3 (host n1) died (process gone)"
    store.set("rankwise/watch/spoke/0", "1")  # its wait for the others to speak ends at once
    finder.spoken((2, 3))
    return watch, store, finder


@pytest.mark.unit
def test_a_survivor_that_hears_nothing_is_told_the_loss_by_one_that_found_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun ends a node's other workers once one exits: a survivor waiting on a live
    peer must not wait out the bound to name the loss, or it is ended unheard."""
    watch, store, _ = _rank_1_found_ranks_2_and_3_died()
    _beat(store, 1)
    watch._read_peers()  # one look: no time has passed, nobody is silent yet
    assert watch.lost == (2, 3)
    told = "ranks 2, 3 (host n1) died (process gone) (as rank 1 found)"
    assert watch.account() == told
    monkeypatch.setattr(_watch, "current", lambda: watch)
    with pytest.raises(_watch.PeersLost, match=re.escape(told)) as lost:
        _watch.wait(_Work())
    assert lost.value.lost == (2, 3)


@pytest.mark.unit
def test_a_told_loss_whose_peers_count_again_is_an_old_group_s_and_ignored() -> None:
    watch, store, _ = _rank_1_found_ranks_2_and_3_died()
    _beat(store, 1, 2, 3)  # ranks 2 and 3 replaced since: counting again
    watch._read_peers()
    assert watch.lost == () and watch.told == ("", ())


@pytest.mark.unit
def test_a_survivor_never_takes_its_own_published_words_as_told() -> None:
    _, _, finder = _rank_1_found_ranks_2_and_3_died()
    finder._read_peers()
    assert finder.told == ("", ())


class _Work:
    """An async collective that never completes, as gloo's does for a frozen peer."""

    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc] "
                           "Operation timed out!")  # fmt: skip


@pytest.mark.unit
def test_a_wait_raises_once_the_watch_finds_peers_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = _ranks_2_and_3_silent()
    monkeypatch.setattr(_watch, "current", lambda: watch)
    with pytest.raises(_watch.PeersLost, match=r"ranks 2, 3 \(host n1\) silent for 11 s") as lost:
        _watch.wait(_Work())
    assert lost.value.lost == (2, 3)
    assert watch.waiting == 0


@pytest.mark.unit
def test_a_wait_on_a_store_that_stopped_answering_names_rank_0_s_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    watch, _, clock = _watch_of(4, bound=10)
    clock.now += 12  # no answer from the store since
    monkeypatch.setattr(_watch, "current", lambda: watch)
    monkeypatch.setenv("MASTER_ADDR", "n0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(_watch.PeersLost, match=r"the launch's store on rank 0's node \(host n0, "
                       r"ranks 0, 1\) has not answered for 12 s") as lost:  # fmt: skip
        _watch.wait(_Work())
    assert lost.value.lost == (0, 1)


@pytest.mark.unit
def test_a_failure_that_is_not_a_timeout_is_the_collective_s_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    watch, _, _ = _watch_of(2)
    monkeypatch.setattr(_watch, "current", lambda: watch)

    class Failed:
        def wait(self, timeout: Any = None) -> bool:
            raise RuntimeError("Connection closed by peer [10.0.0.1]:3")

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _watch.wait(Failed())


@pytest.mark.unit
@pytest.mark.parametrize(
    ("raw", "bound"), [(None, 60.0), ("", 60.0), ("15", 15.0), ("2.5", 2.5), ("0", None)]
)
def test_the_bound_is_a_setting(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, bound: Any
) -> None:
    if raw is None:
        monkeypatch.delenv(_watch.BOUND_ENV, raising=False)
    else:
        monkeypatch.setenv(_watch.BOUND_ENV, raw)
    assert _watch.bound_s() == bound


@pytest.mark.unit
def test_a_bad_bound_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_watch.BOUND_ENV, "soon")
    with pytest.raises(ValueError, match="RANKWISE_PEER_TIMEOUT='soon' is not a number of seconds"):
        _watch.bound_s()


@pytest.mark.unit
def test_no_watch_runs_outside_a_launch() -> None:
    assert _watch.current() is None  # no group here: nothing started, nothing waits in slices


@pytest.mark.unit
def test_a_store_that_closed_its_connections_names_rank_0_s_node_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its node killed, the launch's store refuses (not only stays silent): no bound to wait."""
    watch, store, _ = _watch_of(4, bound=60)

    def gone(key: str, amount: int) -> int:
        raise _watch.dist.DistNetworkError("Broken pipe")

    monkeypatch.setattr(store, "add", gone)
    monkeypatch.setattr(_watch, "current", lambda: watch)
    monkeypatch.setenv("MASTER_ADDR", "n0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    watch._talk()
    assert watch.store_gone
    with pytest.raises(_watch.PeersLost, match=r"the launch's store on rank 0's node \(host n0, "
                       r"ranks 0, 1\) closed its connections") as lost:  # fmt: skip
        _watch.wait(_Work())
    assert lost.value.lost == (0, 1)


@pytest.mark.unit
def test_a_bounded_store_call_that_raises_is_no_answer_and_no_traceback(
    capfd: pytest.CaptureFixture[str],
) -> None:
    def fails() -> None:
        raise RuntimeError("Broken pipe")

    assert _watch._bounded(fails, 5.0) is None
    assert "Traceback" not in capfd.readouterr().err
