"""The keys the harness's ranks write in the pytest process's store are named and signed with
a secret of the session: another local process could read and write every key there, and
its text was reported as a rank's set-up failure (the root cause of tests it never touched)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from harness import ranks, signing


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
    import torch.distributed as dist

    run_on_ranks(_rank, world_size=2)  # the session's store is up
    pools = ranks.pools_of(request.config)
    other = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", pools.store.port, is_master=False, timeout=timedelta(seconds=30)
    )
    serial = next(pools._serial)  # the runs to come, as anyone could count them
    for run in range(serial, serial + 40):
        for r in range(2):
            other.set(f"run{run}//setup/{r}", "ForgedError: written by another user")
    for _ in range(8):
        out = run_on_ranks(_rank, world_size=2)
        assert out.values == [0, 1], out.report()


def test_another_user_cannot_change_a_verdict_through_the_store(
    run_on_ranks: Any, request: pytest.FixtureRequest
) -> None:
    """As user nobody, through the store's port: the forged set-up failures under the keys
    as they were named reach no rank (the keys carry a tag of the session's secret)."""
    from tests.harness import other_user

    if other_user.skip_reason() is not None:
        pytest.skip(other_user.skip_reason())
    run_on_ranks(_rank, world_size=2)
    pools = ranks.pools_of(request.config)
    serial = next(pools._serial)
    forged = b"ForgedError: written by another user"
    items = {f"run{run}//setup/{r}": forged for run in range(serial, serial + 40) for r in (0, 1)}
    other_user.write(pools.store.port, items)
    for _ in range(8):
        out = run_on_ranks(_rank, world_size=2)
        assert out.values == [0, 1], out.report()
