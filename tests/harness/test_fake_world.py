"""fake_world: one rank of a world of any size that knows its mesh and nodes, records its
collectives, sweeps ranks, composes with launch_env, and never lets rankwise's collectives
return a plausible wrong value."""

from __future__ import annotations

import os
from typing import Any

import pytest
import rankwise as rw
import torch
import torch.distributed as dist
from rankwise.testing import NotSimulatedError

# ---- rankwise's collectives on a fake world: what each rank would see, or a clear refusal ---

_REFUSED = "not simulated on a fake world"


@pytest.mark.parametrize("rank", [0, 1, 7])
def test_all_reduce_and_synced_objects_refuse_instead_of_inventing_peers(
    fake_world: Any, rank: int
) -> None:
    fake_world(8, rank=rank)
    # torch's fake backend gives every "peer" this rank's own value: 56, [3]*8, 24
    with pytest.raises(NotSimulatedError, match=f"all_reduce\\('x'\\) on rank {rank}: {_REFUSED}"):
        rw.all_reduce("x", lambda: 7, sum)
    with pytest.raises(NotSimulatedError, match="the values of the other 7 ranks"):
        rw.all_reduce("y", lambda: [3], lambda values: [v for each in values for v in each])
    group = rw.DistributedProcessGroup()
    with pytest.raises(NotSimulatedError, match=f"get_dist_syncd_obj on rank {rank}"):
        rw.DistributedProcessGroup.get_dist_syncd_obj(3, group, sum)


@pytest.mark.parametrize("rank", [0, 2, 5])
def test_broadcast_from_returns_the_sources_value_on_the_source_only(
    fake_world: Any, rank: int
) -> None:
    fake_world(6, rank=rank)
    value = {"weights": torch.arange(3.0), "step": 4}
    if rank == 2:
        got = rw.broadcast_from("cfg", lambda: value, src=2)
        assert got["step"] == 4 and torch.equal(got["weights"], value["weights"])
        assert got is not value  # a copy loaded from the bytes sent, as on real ranks
        big = rw.broadcast_from("big", lambda: torch.arange(10_000.0), src=2)
        assert torch.equal(big, torch.arange(10_000.0))
    else:
        # not the tampered-sender wording ("does not load with torch.load...")
        with pytest.raises(NotSimulatedError, match="the value of src rank 2"):
            rw.broadcast_from("cfg", lambda: value, src=2)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_gathers_return_none_where_a_rank_only_sends_and_refuse_on_dst(
    fake_world: Any, rank: int
) -> None:
    fake_world(4, rank=rank)
    if rank == 1:
        with pytest.raises(NotSimulatedError, match=r"gather_bytes\(dst=1\) on rank 1"):
            rw.gather_bytes(b"abc", dst=1)
        with pytest.raises(NotSimulatedError, match=r"gather_state_dicts\(dst=1\)"):
            rw.gather_state_dicts({"w": torch.ones(2)}, dst=1)
    else:
        assert rw.gather_bytes(b"abc", dst=1) is None
        assert list(rw.gather_state_dicts({"w": torch.ones(2)}, dst=1)) == []


def test_a_rank_s_own_bad_input_is_still_its_own_error_on_a_fake_world(fake_world: Any) -> None:
    fake_world(4, rank=1)
    with pytest.raises(TypeError, match="label must be a str"):
        rw.all_reduce(3, lambda: 1, sum)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="data must be bytes"):
        rw.gather_bytes("text", dst=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="src=9 is not a rank"):
        rw.broadcast_from("x", lambda: 1, src=9)


def test_on_a_subgroup_of_a_fake_world_too(fake_world: Any) -> None:
    world = fake_world(8, rank=5, mesh=(2, 4), mesh_dim_names=("dp", "tp"))
    tp = rw.DistributedProcessGroup(world.mesh.get_group("tp"))
    assert (tp.rank(), tp.world_size()) == (1, 4)
    with pytest.raises(NotSimulatedError, match="the other 3 ranks"):
        rw.DistributedProcessGroup.get_dist_syncd_obj(1, tp, sum)
    with pytest.raises(NotSimulatedError):
        rw.gather_bytes(b"x", dst=5, group=world.mesh.get_group("tp"))


def test_torch_s_own_collectives_behave_as_the_docs_say(fake_world: Any) -> None:
    """docs/fixtures.md's table of torch's collectives on a fake world."""
    fake_world(4, rank=2)
    t = torch.tensor([1.0, 2.0])
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 2.0]  # left as it was
    slots = [torch.zeros(1) for _ in range(4)]
    dist.all_gather(slots, torch.tensor([7.0]))
    assert [s.item() for s in slots] == [7.0] * 4  # this rank's data in every slot
    objects: list[Any] = [None] * 4
    dist.all_gather_object(objects, {"r": 2})
    assert objects == [{"r": 2}] * 4


# ---- its shape: mesh, nodes, the launch environment ----------------------------------------


def test_a_fake_world_knows_its_mesh_nodes_and_local_rank(fake_world: Any) -> None:
    world = fake_world(16, rank=13, local_world_size=4, mesh=(4, 4), mesh_dim_names=("dp", "tp"))
    assert (world.rank, world.world_size, world.node, world.nodes) == (13, 16, 3, 4)
    assert (world.local_rank, world.local_world_size) == (1, 4)
    assert world.mesh_coordinate() == (3, 1)
    assert dist.get_process_group_ranks(world.mesh.get_group("tp")) == [12, 13, 14, 15]
    assert dist.get_process_group_ranks(world.mesh.get_group("dp")) == [1, 5, 9, 13]
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["GROUP_RANK"] == "3"
    assert "node 3 of 4" in repr(world)


def test_the_world_size_can_come_from_the_mesh(fake_world: Any) -> None:
    world = fake_world(mesh=(8, 8), mesh_dim_names=("dp", "tp"), rank=9)
    assert world.world_size == 64 and world.mesh_coordinate() == (1, 1)


def test_fake_world_follows_what_launch_env_set(fake_world: Any, launch_env: Any) -> None:
    launch_env(world_size=8, rank=3, local_world_size=4)
    world = fake_world()
    assert (world.rank, world.world_size, world.node, world.local_rank) == (3, 8, 0, 3)
    assert (rw.rank(), rw.size(), rw.is_master()) == (3, 8, False)
    assert os.environ["TORCHELASTIC_ERROR_FILE"].endswith(os.path.join("rank3", "error.json"))


def test_fake_world_refuses_sizes_launch_env_contradicts(fake_world: Any, launch_env: Any) -> None:
    launch_env(world_size=8, rank=3)
    with pytest.raises(ValueError, match="world_size=16 but launch_env set WORLD_SIZE=8"):
        fake_world(16)
    with pytest.raises(ValueError, match="rank=2 but launch_env set RANK=3"):
        fake_world(8, rank=2)


def test_fake_world_sets_the_whole_launch_environment_of_its_rank(
    fake_world: Any, tmp_path: Any
) -> None:
    world = fake_world(8, rank=6, local_world_size=2)
    assert world.env["RANK"] == os.environ["RANK"] == "6"
    assert os.environ["LOCAL_RANK"] == "0" and os.environ["GROUP_WORLD_SIZE"] == "4"
    assert os.environ["TORCHELASTIC_ERROR_FILE"].startswith(str(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({}, "give world_size"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"world_size": 4, "rank": 4}, r"rank must be in 0..3"),
        ({"world_size": 6, "local_world_size": 4}, "local_world_size 4 must divide"),
        ({"world_size": 8, "mesh": (2, 2)}, r"mesh \(2, 2\) holds 4 ranks, not world_size 8"),
        ({"world_size": 4, "mesh": (2, 2), "mesh_dim_names": ("a",)}, "must name each"),
        ({"world_size": 4, "mesh_dim_names": ("a",)}, "mesh_dim_names needs a mesh"),
    ],
)
def test_impossible_fake_worlds_say_what_is_wrong(
    fake_world: Any, kwargs: dict[str, Any], said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        fake_world(**kwargs)
    assert not dist.is_initialized()


# ---- sweeps: one test, many ranks of a large plan -------------------------------------------


def test_a_sweep_checks_dtensor_and_fsdp2_shapes_on_a_sample_of_4096_ranks(
    fake_world: Any,
) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    seen = []
    for world in fake_world.sweep(
        4096, sample=12, local_world_size=8, mesh=(64, 64), mesh_dim_names=("dp", "tp")
    ):
        dp = world.mesh_coordinate()[0]
        local = distribute_tensor(torch.zeros(130, 64), world.mesh, [Shard(0), Replicate()])
        # 130 rows over 64 dp ranks: torch.chunk gives 3 rows to the first 43, 1 to the 44th
        assert local.to_local().shape[0] == (3 if dp < 43 else 1 if dp == 43 else 0)
        layer = torch.nn.Linear(130, 8)
        fully_shard(layer, mesh=world.mesh["dp"])
        assert layer.weight.to_local().shape == ((1, 130) if dp < 8 else (0, 130))
        seen.append((world.rank, world.node))
    assert len(seen) == 12 and seen[0] == (0, 0) and seen[-1] == (4095, 511)
    assert not dist.is_initialized()  # each world torn down before the next


def test_a_sweep_visits_every_rank_or_the_ones_named(fake_world: Any) -> None:
    assert [w.rank for w in fake_world.sweep(4)] == [0, 1, 2, 3]
    assert [w.rank for w in fake_world.sweep(4096, ranks=[5, 4000])] == [5, 4000]
    with pytest.raises(ValueError, match=r"rank 9 is not in 0\.\.7"):
        list(fake_world.sweep(8, ranks=[9]))


# ---- the record of collectives --------------------------------------------------------------


def test_an_fsdp2_step_s_collectives_are_recorded_per_mesh_dimension(fake_world: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    world = fake_world(64, rank=9, mesh=(8, 8), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    for layer in model:
        fully_shard(layer, mesh=world.mesh["dp"])
    fully_shard(model, mesh=world.mesh["dp"])  # the root: its layers reshard after forward
    with world.record() as log:
        model(torch.ones(2, 64)).sum().backward()
        dist.all_reduce(torch.ones(4), group=world.mesh.get_group("tp"))
    gathers = log.of("all_gather_into_tensor", mesh_dim="dp")
    assert len(gathers) == 4  # each layer gathered for forward, again for backward
    whole = (64 * 32 + 32) * 4, (32 * 16 + 16) * 4  # each layer's parameters, fp32
    assert sorted({g.bytes_out for g in gathers}) == sorted(whole)
    assert all(g.ranks == tuple(range(1, 64, 8)) for g in gathers)
    assert log.count("reduce_scatter_tensor", mesh_dim="dp") == 2
    assert log.of("all_reduce") == [type(log[0])("all_reduce", tuple(range(8, 16)), "tp", 16, 16)]
    assert log.bytes_out("all_gather_into_tensor") == 2 * sum(whole)


def test_the_record_is_empty_outside_its_block(fake_world: Any) -> None:
    world = fake_world(4)
    with world.record() as log:
        pass
    dist.all_reduce(torch.ones(1))
    assert log == []
