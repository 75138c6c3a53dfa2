"""The record of the collectives a process issues, tested directly in this process on torch's
fake backend (nothing moves, no process): each collective's op, group and bytes, in issue
order, whatever issues it, and the log's counts and sums."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness.simulation.collective_log import CollectiveLog, CollectiveRecord, recording

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_group() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_each_collective_is_recorded_with_its_group_and_bytes(fake_group: None) -> None:
    with recording(lambda name: "dp") as mode:
        t = torch.ones(8)  # 32 bytes
        dist.all_reduce(t)
        dist.all_gather([torch.empty(8) for _ in range(4)], t)
        dist.barrier()
    log = mode.log
    assert [r.op for r in log] == ["all_reduce", "all_gather", "barrier"]
    reduce, gather = log[0], log[1]
    assert reduce.ranks == (0, 1, 2, 3) and reduce.mesh_dim == "dp"
    assert (reduce.bytes_in, reduce.bytes_out) == (32, 32)
    assert (gather.bytes_in, gather.bytes_out) == (32, 128)  # the group's size times its input


def test_the_logs_counts_and_sums_by_op_and_mesh_dimension() -> None:
    log = CollectiveLog(
        [
            CollectiveRecord("all_gather_into_tensor", (0, 1), "dp", 4, 8),
            CollectiveRecord("all_gather_into_tensor", (0, 2), "tp", 4, 8),
            CollectiveRecord("all_reduce", (0, 1), "dp", 16, 16),
        ]
    )
    assert log.count() == 3 and log.count("all_gather_into_tensor") == 2
    assert log.count(mesh_dim="dp") == 2 and log.count("all_reduce", "tp") == 0
    assert log.bytes_out("all_gather_into_tensor") == 16 and log.bytes_in(mesh_dim="dp") == 20
    assert [r.mesh_dim for r in log.of("all_gather_into_tensor")] == ["dp", "tp"]
