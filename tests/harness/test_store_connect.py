"""A test's own TCPStore rendezvous on warm ranks (harness/rank/store_connect.py): a client is
made only once its host listens (torch's client, refused, pauses about half a second), the
host at once; then the same on real warm ranks, env:// group after group."""

from __future__ import annotations

import importlib
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from harness.common import listening
from harness.rank import store_connect

# The module: torch.distributed exports a function of the same name.
rendezvous = importlib.import_module("torch.distributed.rendezvous")


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """torch's TCPStore replaced by a recorder, then the harness's wait installed over it."""
    calls: list[dict[str, Any]] = []

    def recorder(*args: Any, **kwargs: Any) -> str:
        calls.append({"args": args, "kwargs": kwargs})
        return "a store"

    monkeypatch.setattr(rendezvous, "TCPStore", recorder)
    store_connect.connect_when_listening()
    yield calls


@pytest.fixture
def unopened() -> Iterator[socket.socket]:
    """A loopback port bound but not listening yet: a connection is refused."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        yield listener


def _port(listener: socket.socket) -> int:
    return int(listener.getsockname()[1])


@pytest.mark.unit
def test_a_client_is_made_once_its_host_listens(
    made: list[dict[str, Any]], unopened: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[bool] = []
    real = socket.create_connection

    def trying(*args: Any, **kwargs: Any) -> Any:
        try:
            connection = real(*args, **kwargs)
        except OSError:
            tries.append(False)
            if len(tries) == 2:
                unopened.listen()  # the host comes up after the client's second try
            raise
        tries.append(True)
        return connection

    monkeypatch.setattr(socket, "create_connection", trying)
    port = _port(unopened)
    store = rendezvous.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
    assert store == "a store" and tries == [False, False, True]
    assert made == [{"args": ("127.0.0.1", port, 2, False, timedelta(seconds=60)), "kwargs": {}}]


@pytest.mark.unit
def test_a_client_named_by_keywords_waits_too(
    made: list[dict[str, Any]], unopened: socket.socket
) -> None:
    unopened.listen()
    port = _port(unopened)
    rendezvous.TCPStore(host_name="127.0.0.1", port=port, is_master=False, multi_tenant=True)
    assert made == [
        {"args": (), "kwargs": {"host_name": "127.0.0.1", "port": port, "is_master": False,
                                "multi_tenant": True}},
    ]  # fmt: skip


@pytest.mark.unit
def test_the_host_is_made_at_once(
    made: list[dict[str, Any]], unopened: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the host rank tried to connect before it listens")

    monkeypatch.setattr(socket, "create_connection", never)
    rendezvous.TCPStore("127.0.0.1", _port(unopened), 2, True, timedelta(seconds=60))
    rendezvous.TCPStore("127.0.0.1", _port(unopened), is_master=True)
    assert len(made) == 2


@pytest.mark.unit
def test_a_host_that_never_listens_is_left_to_torchs_own_error(
    made: list[dict[str, Any]], unopened: socket.socket
) -> None:
    """Past the store's timeout the client is made anyway: torch reports the failed
    connection in its own words, as it would without the harness."""
    rendezvous.TCPStore("127.0.0.1", _port(unopened), 2, False, timedelta(seconds=0.2))
    assert len(made) == 1


@pytest.mark.unit
def test_a_host_later_than_a_few_seconds_is_left_to_torch(
    made: list[dict[str, Any]], unopened: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store timeout of 30 minutes (init_process_group's) is torch's to wait out: the
    harness's own wait ends after a few seconds, so a host that never comes fails as it
    would without the harness, not after twice the timeout."""
    bounds: list[float] = []
    monkeypatch.setattr(listening, "await_listening", lambda h, p, s, **_: bounds.append(s))
    rendezvous.TCPStore("127.0.0.1", _port(unopened), 2, False, timedelta(minutes=30))
    rendezvous.TCPStore("127.0.0.1", _port(unopened), 2, False, timedelta(seconds=1))
    assert bounds == [store_connect._AWAIT_AT_MOST_S, 1.0] and len(made) == 2


@pytest.mark.unit
def test_installed_once(made: list[dict[str, Any]]) -> None:
    installed = rendezvous.TCPStore
    store_connect.connect_when_listening()
    assert rendezvous.TCPStore is installed


ENV_GROUPS = """
import importlib
import os
import pytest
import torch
import torch.distributed as dist

@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", range(6))
def test_env_group(rank, world_size, i, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", os.environ["PORT_%d" % i])
    dist.destroy_process_group()  # the harness's own group: the test sets its own up
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    assert getattr(rendezvous.TCPStore, "_harness_waits", False)
    dist.destroy_process_group()
"""


def _free_ports(count: int) -> list[int]:
    ports = []
    for _ in range(count):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(int(probe.getsockname()[1]))
    return ports


def test_env_groups_set_up_by_tests_on_warm_ranks(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i, port in enumerate(_free_ports(6)):
        monkeypatch.setenv(f"PORT_{i}", str(port))
    inner.makepyfile(test_env=ENV_GROUPS)
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=6)
