"""DTensor values and FSDP2-sharded state dicts through every collective that moves values.

A regression made every value holding a DTensor fail on every rank ("cannot be saved with
torch.save"): gather_state_dicts of an FSDP2 model's state dict, all_reduce, broadcast_from
and get_dist_syncd_obj (modelopt's AWQ sync under FSDP2).
"""

from __future__ import annotations

from typing import Any

import pytest
import rankwise as rw
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def _mesh(world_size: int) -> Any:
    return init_device_mesh("cpu", (world_size,))


@pytest.mark.ranks(2, 4)
def test_an_fsdp2_state_dict_gathers_to_dst(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    expected = {name: p.detach().clone() for name, p in model.state_dict().items()}
    fully_shard(model[0])
    fully_shard(model)
    state = model.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values())
    gathered = list(rw.gather_state_dicts(state, dst=1))
    if rank != 1:
        assert gathered == []
        return
    assert len(gathered) == world_size
    for source, got in enumerate(gathered):
        for name, value in got.items():
            assert isinstance(value, DTensor), name
            local = state[name].to_local() if source == rank else value.to_local()
            assert torch.equal(value.to_local(), local), (source, name)
        rows = [v.to_local() for v in got.values()]
        assert all(r.device.type == "cpu" for r in rows)
    for name, full in expected.items():  # the shards, concatenated, are the whole tensor
        pieces = [g[name].to_local() for g in gathered]
        assert torch.equal(torch.cat(pieces), full), name


@pytest.mark.ranks(2, 4)
def test_dtensor_values_through_all_reduce_and_broadcast_from(rank: int, world_size: int) -> None:
    mesh = _mesh(world_size)
    sharded = distribute_tensor(torch.arange(4.0 * world_size), mesh, [Shard(0)])
    values = rw.all_reduce("shards", lambda: {"w": sharded}, lambda xs: xs)
    assert [v["w"].to_local().tolist() for v in values] == [
        [4.0 * r + i for i in range(4)] for r in range(world_size)
    ]
    replicated = distribute_tensor(torch.full((2,), 7.0), mesh, [Replicate()])
    got = rw.broadcast_from("replicated", lambda: replicated, src=world_size - 1)
    assert isinstance(got, DTensor) and got.placements == (Replicate(),)
    assert torch.equal(got.to_local(), torch.full((2,), 7.0))


@pytest.mark.ranks(2)
def test_get_dist_syncd_obj_of_a_dtensor(rank: int, world_size: int) -> None:
    """modelopt's AWQ sync under FSDP2: each rank's amax, a DTensor, combined by max."""
    mesh = _mesh(world_size)
    local = torch.tensor([1.0 + rank, 5.0 - rank])
    amax = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    group = rw.DistributedProcessGroup(None)

    def elementwise_max(values: list[Any]) -> torch.Tensor:
        return torch.stack([v.to_local() for v in values]).amax(0)

    combined = rw.DistributedProcessGroup.get_dist_syncd_obj(amax, group, elementwise_max)
    assert combined.tolist() == [2.0, 5.0]
    dist.barrier()
