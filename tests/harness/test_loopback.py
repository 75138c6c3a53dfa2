"""Every listener the harness starts is on the loopback interface: torch's TCPStore server
listened on every interface (``*:PORT``) although the harness asked for 127.0.0.1, and gloo's
pairs were on 127.0.0.1 only because the host name resolved there. Read from /proc/net/tcp."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from harness.common import loopback
from harness.warm import session as warm_session

_LISTEN = "0A"
_LOOPBACK_V4 = "0100007F"


def _listeners() -> list[tuple[str, int, int]]:
    """Every listening TCP socket here: (local address in /proc's hex, port, inode)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].rsplit(":", 1)
            if fields[3] == _LISTEN:
                found.append((address, int(port, 16), int(fields[9])))
    return found


def _on(port: int) -> list[str]:
    return [address for address, p, _ in _listeners() if p == port]


def test_a_harness_store_listens_on_loopback_only() -> None:
    server = loopback.store()
    assert _on(server.port) == [_LOOPBACK_V4]


def _master_port_listeners() -> list[str]:
    return _on(int(os.environ["MASTER_PORT"]))


def test_a_launch_store_listens_on_loopback_only(run_on_ranks: Any) -> None:
    """A launch-mode test's store (torchrun's agent store, as the test's own rendezvous
    expects it); warm ranks' own store is a private file (test_signing.py)."""
    out = run_on_ranks(_master_port_listeners, world_size=2, launch=True)
    assert out.values == [[_LOOPBACK_V4]] * 2


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


@pytest.mark.ranks(2, fresh_group=True)
def test_the_group_the_harness_sets_up_listens_on_loopback(rank: int) -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # every pair connected
    mine = _own_socket_inodes()
    addresses = {address for address, _, inode in _listeners() if inode in mine}
    assert addresses == {_LOOPBACK_V4}, addresses
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # set for the harness's set-up alone


def _private(path: Path) -> bool:
    return path.stat().st_mode & 0o077 == 0


def _nothing() -> None:
    return None


def test_the_work_directory_is_private(run_on_ranks: Any, request: pytest.FixtureRequest) -> None:
    """Another local user can read none of what ranks write: the session's work directory
    (each rank's output, stacks and where-buffer live below it) is 0700."""
    run_on_ranks(_nothing, world_size=2)  # the pools and their files exist
    pools = warm_session.pools_of(request.config)
    workdir = pools._workdir
    assert _private(workdir)
    rank_dirs = [d for d in workdir.iterdir() if d.is_dir()]
    assert rank_dirs and all(_private(d) for d in rank_dirs)
    assert any(f.name.startswith("rank0.") for d in rank_dirs for f in d.iterdir())


@pytest.mark.ranks(2)
def test_shared_tmp_path_is_private(rank: int, shared_tmp_path: Path) -> None:
    """pytest's base temporary directory (below which it lies) is the user's alone."""
    assert any(_private(parent) for parent in [shared_tmp_path, *shared_tmp_path.parents][:4])
