"""A first multi-rank test file: run it with ``pytest -p harness --ranks 4 examples/quickstart``."""

import pytest
import torch
import torch.distributed as dist


@pytest.mark.ranks
def test_all_reduce_sums_every_rank(rank: int, world_size: int) -> None:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    assert value.item() == world_size * (world_size + 1) / 2


@pytest.mark.ranks(2, 4)
def test_broadcast_reaches_every_rank(rank: int) -> None:
    value = torch.tensor([42.0 if rank == 0 else 0.0])
    dist.broadcast(value, src=0)
    assert value.item() == 42.0
