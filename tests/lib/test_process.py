"""Process queries and group wrappers: single process, launch environment, live groups."""

from __future__ import annotations

from typing import Any

import pytest
import rankwise as rw
import torch.distributed as dist


def test_a_single_process_is_rank_0_of_1() -> None:
    assert rw.is_available()
    assert not rw.is_initialized()
    assert rw.backend() is None
    assert (rw.rank(), rw.size(), rw.is_master()) == (0, 1, True)
    rw.barrier()  # returns at once
    assert not rw.is_distributed_launch()
    assert not rw.is_distributed_run()


def test_launch_is_read_from_the_environment_before_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert rw.is_distributed_launch()
    assert not rw.is_distributed_run()  # no live group yet
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not rw.is_distributed_launch()


@pytest.mark.parametrize("bad", ["four", "0", "-2", "2.5"])
def test_a_malformed_world_size_says_what_to_fix(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", bad)
    with pytest.raises(ValueError, match=rf"WORLD_SIZE='{bad}' is not a positive integer"):
        rw.is_distributed_launch()


@pytest.mark.ranks(4)
def test_queries_read_the_live_group(rank: int, world_size: int) -> None:
    assert rw.is_initialized() and rw.backend() == "gloo"
    assert (rw.rank(), rw.size()) == (rank, world_size)
    assert rw.is_master() == (rank == 0)
    assert rw.is_distributed_run()
    assert not rw.is_distributed_launch()  # the harness set the group up without torchrun's env
    odd = dist.new_group([1, 3])
    if rank in (1, 3):
        assert (rw.rank(odd), rw.size(odd), rw.is_master(odd)) == ([1, 3].index(rank), 2, rank == 1)
        rw.barrier(odd)
    rw.barrier()


def _queries() -> tuple[bool, bool, int]:
    return rw.is_initialized(), rw.is_distributed_run(), rw.size()


def test_a_one_rank_group_is_not_a_distributed_run(run_on_ranks: object) -> None:
    out = run_on_ranks(_queries, world_size=1)  # type: ignore[operator]
    assert out.values == [(True, False, 1)]


# ---- DistributedProcessGroup and ParallelState ---------------------------------------------


def test_group_wrappers_in_a_single_process() -> None:
    world = rw.DistributedProcessGroup()
    assert (world.is_initialized(), world.rank(), world.world_size()) == (False, 0, 1)
    unused = rw.DistributedProcessGroup(-1)
    assert (unused.is_initialized(), unused.rank(), unused.world_size()) == (False, -1, -1)
    assert repr(unused) == "DistributedProcessGroup(not in use)"
    assert repr(world) == "DistributedProcessGroup(world, rank=0, world_size=1, initialized=False)"


@pytest.mark.parametrize("bad", [3, 0, True])
def test_group_wrapper_rejects_other_ints(bad: int) -> None:
    with pytest.raises(ValueError, match="None \\(the whole world\\) or -1 \\(not in use\\)"):
        rw.DistributedProcessGroup(bad)


def test_group_wrapper_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="got str"):
        rw.DistributedProcessGroup("world")


def test_synced_object_skips_groups_not_in_use_as_modelopt_does() -> None:
    groups = [rw.DistributedProcessGroup(), rw.DistributedProcessGroup(-1)]
    # No live group here: neither is initialised, op is never called, obj comes back as is.
    assert rw.DistributedProcessGroup.get_dist_syncd_obj(5, groups, lambda xs: xs) == 5
    assert rw.DistributedProcessGroup.get_dist_syncd_obj(5, groups[0], sum) == 5


@pytest.mark.ranks(4)
def test_synced_object_over_live_groups(rank: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = rw.DistributedProcessGroup(pairs[rank // 2])
    world = rw.DistributedProcessGroup(None)
    assert mine.is_initialized() and mine.world_size() == 2 and mine.rank() == rank % 2
    assert "rank=" in repr(mine) and "world_size=2" in repr(mine)
    # Sum within each pair (1 and 5), then over the world: 1 + 1 + 5 + 5 on every rank.
    assert rw.DistributedProcessGroup.get_dist_syncd_obj(rank, [mine, world], sum) == 12
    assert rw.DistributedProcessGroup.get_dist_syncd_obj(rank, [mine, world], max) == 3
    unused = rw.DistributedProcessGroup(-1)
    assert rw.DistributedProcessGroup.get_dist_syncd_obj(rank, unused, lambda xs: xs) == rank
    # ParallelState's defaults (tensor and expert parallel not in use) leave only the world.
    state = rw.ParallelState()
    every = [state.data_parallel_group, state.tensor_parallel_group]
    every.append(state.expert_model_parallel_group)
    found = rw.DistributedProcessGroup.get_dist_syncd_obj(rank, every, lambda xs: xs)
    assert found == [0, 1, 2, 3]


def test_parallel_state_defaults_and_repr() -> None:
    state = rw.ParallelState()
    assert state.data_parallel_group.group is None
    assert state.tensor_parallel_group.group == -1
    assert state.expert_model_parallel_group.group == -1
    assert repr(state).startswith("ParallelState(data_parallel_group=DistributedProcessGroup(world")
    assert "tensor_parallel_group=DistributedProcessGroup(not in use)" in repr(state)


@pytest.mark.ranks(2)
def test_parallel_state_holds_live_groups(rank: int) -> None:
    tp = dist.new_group([0, 1])
    state = rw.ParallelState(data_parallel_group=None, tensor_parallel_group=tp)
    assert state.tensor_parallel_group.world_size() == 2
    assert state.expert_model_parallel_group.world_size() == -1


@pytest.mark.ranks(2)
def test_a_group_this_rank_is_not_in_reads_as_not_a_member(rank: int) -> None:
    only_zero = rw.DistributedProcessGroup(dist.new_group([0]))  # torch's sentinel on rank 1
    expected = (True, 0, 1) if rank == 0 else (False, -1, -1)
    assert (only_zero.is_initialized(), only_zero.rank(), only_zero.world_size()) == expected
    # rank 0 combines its value alone; for rank 1, not a member, the group is skipped.
    found = rw.DistributedProcessGroup.get_dist_syncd_obj(rank, only_zero, lambda xs: xs)
    assert found == ([0] if rank == 0 else 1)
    assert "not a member" in repr(only_zero) or rank == 0


class _Payload:
    """Runs a command when unpickled: a value pickle would run on every receiving rank."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (__import__("os").system, (f"touch {self.marker}",))


def _sync_a_crafted_value(marker: str) -> object:
    value: object = _Payload(marker) if dist.get_rank() == 1 else 1
    return rw.DistributedProcessGroup.get_dist_syncd_obj(value, rw.DistributedProcessGroup(), list)


def test_a_crafted_synced_value_is_refused_and_never_run(run_on_ranks: Any, tmp_path: Any) -> None:
    from harness import Ending

    marker = tmp_path / "payload-ran"
    out = run_on_ranks(_sync_a_crafted_value, str(marker), world_size=2, timeout=20)
    assert out.endings == [Ending.RAISED, Ending.RAISED]
    assert out[1].exc_name == "WireError" and "type _Payload" in out[1].message
    assert not marker.exists()


class Opaque:
    """Not registered with add_safe_globals: cannot load with weights_only."""


def _sync_opaque_on_rank_1() -> object:
    value: object = Opaque() if dist.get_rank() == 1 else 1
    return rw.DistributedProcessGroup.get_dist_syncd_obj(value, rw.DistributedProcessGroup(), list)


def test_a_synced_value_that_does_not_round_trip_raises_on_every_rank(
    run_on_ranks: Any,
) -> None:
    from harness import Ending

    out = run_on_ranks(_sync_opaque_on_rank_1, world_size=2, timeout=20)
    assert out.endings == [Ending.RAISED, Ending.RAISED]
    assert out[1].exc_name == "WireError" and "type Opaque" in out[1].message
    assert "torch.serialization.add_safe_globals" in out[1].message
    assert out[0].exc_name == "RuntimeError" and "rank 1 raised WireError" in out[0].message


@pytest.mark.parametrize("query", ["rank", "size", "is_master", "barrier"])
def test_a_group_that_is_no_process_group_is_a_clear_error(query: str) -> None:
    """rank(-1) passed -1 straight to torch (or returned 0 without a group)."""
    with pytest.raises(TypeError, match=rf"{query}: group must be a ProcessGroup or None; got -1"):
        getattr(rw, query)(-1)


def test_distribution_plan_of_something_that_is_no_module_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"distribution_plan: model must be a torch\.nn\.Module"):
        rw.distribution_plan(None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"set_distribution_plan: model must be a torch\.nn\.Module"
    ):
        rw.set_distribution_plan("llama", rw.DistributionPlan())  # type: ignore[arg-type]
