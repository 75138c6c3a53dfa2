"""The keys the harness's ranks write in the pytest process's store are named and signed with
a secret of the session: another local process could read and write every key there, and
its text was reported as a rank's set-up failure (the root cause of tests it never touched)."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from harness.common import signing
from harness.warm import session as warm_session


def test_a_signed_value_reads_back_and_a_changed_one_does_not() -> None:
    secret = signing.new_secret()
    blob = signing.sign(secret, "run7/setup/1", "ConnectionError: refused")
    assert signing.verify(secret, "run7/setup/1", blob) == b"ConnectionError: refused"
    assert signing.verify(secret, "run8/setup/1", blob) is None  # another key: a replay
    assert signing.verify(signing.new_secret(), "run7/setup/1", blob) is None
    assert signing.verify(secret, "run7/setup/1", b"forged") is None
    forged = blob[:-3] + b"xyz"
    assert signing.verify(secret, "run7/setup/1", forged) is None


def test_key_names_need_the_secret() -> None:
    secret = signing.new_secret()
    named = signing.key(secret, "setup/1")
    assert named.startswith("setup/1/") and named != signing.key(signing.new_secret(), "setup/1")
    assert signing.key(None, "setup/1") == "setup/1"  # no secret: as it is


def _rank() -> int:
    """This rank, after a collective; the group is left for a fresh one in the next call."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()  # so that the next call sets a group up, through the store
    return rank


def test_values_another_process_writes_in_the_store_change_no_verdict(
    run_on_ranks: Any, request: pytest.FixtureRequest
) -> None:
    """A process that reaches the store's file (only the session's user can) and writes
    set-up failures under the keys' names as they would be without the secret: ignored."""
    import torch.distributed as dist

    run_on_ranks(_rank, world_size=2)  # the session's store is up
    pools = warm_session.pools_of(request.config)
    other = dist.FileStore(pools.store_path, -1)  # type: ignore[attr-defined]
    serial = next(pools._serial)  # the runs to come, as anyone could count them
    for run in range(serial, serial + 40):
        for r in range(2):
            other.set(f"run{run}//setup/{r}", "ForgedError: written by another process")
    for _ in range(8):
        out = run_on_ranks(_rank, world_size=2)
        assert out.values == [0, 1], out.report()


def test_another_user_can_reach_neither_the_store_nor_the_work_directory(
    run_on_ranks: Any, request: pytest.FixtureRequest
) -> None:
    """As user nobody: the store's file, and the work directory it lies in, cannot be
    opened, listed or written; the pytest process listens on no port another user could
    connect to instead."""
    from tests.harness import other_user

    if other_user.skip_reason() is not None:
        pytest.skip(other_user.skip_reason())
    run_on_ranks(_rank, world_size=2)
    pools = warm_session.pools_of(request.config)
    assert Path(pools.store_path).exists()
    tries = other_user.try_to_reach([pools.store_path, str(pools._workdir)])
    assert tries == {pools.store_path: "PermissionError", str(pools._workdir): "PermissionError"}
    assert _listening_ports_of_this_process() == []


def _listening_ports_of_this_process() -> list[int]:
    """The TCP ports this (the pytest) process listens on, on any address."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:  # LISTEN
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_process_that_lists_the_stores_keys_changes_no_verdict(
    run_on_ranks: Any, request: pytest.FixtureRequest
) -> None:
    """A store on a port serves its keys' names to whoever asks (TCPStore's list_keys): a
    process that read them wrote forged set-up failures under the next runs' names. Warm
    ranks meet through a store no other process can reach, so there is nothing to list."""
    import torch.distributed as dist

    run_on_ranks(_rank, world_size=2)  # a set-up went through the session's store
    forged = 0
    for port in _listening_ports_of_this_process():
        other = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)
        )
        for key in other.list_keys():
            run, sep, rest = key.partition("//")
            if sep and run.startswith("run") and rest.startswith("setup/"):
                for later in range(int(run[3:]) + 1, int(run[3:]) + 40):
                    other.set(f"run{later}//{rest}", "ForgedError: written by another process")
                    forged += 1
    for _ in range(8):
        out = run_on_ranks(_rank, world_size=2)
        assert out.values == [0, 1], out.report()
    assert forged == 0, "the warm ranks' store was reachable on a port"
