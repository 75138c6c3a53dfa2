"""The simulation's worlds tested directly in this process (no fixture, no process): a fake
world's shape from the call and the launch's environment, with a clear error for one that
cannot be, the ranks a sweep visits, and thread-ranks' values or the rank that failed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.simulation import fake_world
from harness.simulation.threaded_world import ThreadedWorldError, run_threaded

pytestmark = pytest.mark.unit


def test_a_fake_worlds_shape_comes_from_the_call_or_the_launch() -> None:
    shape = fake_world.shape_of(None, None, (2, 4), ("dp", "tp"), {})
    assert (shape.world_size, shape.local_world_size, shape.mesh) == (8, 8, (2, 4))
    launched = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "9"}
    shape = fake_world.shape_of(None, None, None, None, launched)
    assert (shape.world_size, shape.local_world_size) == (16, 8)
    assert fake_world.rank_of(shape, None, launched) == 9


@pytest.mark.parametrize(
    ("world", "local", "said"),
    [
        (None, None, "give world_size"),
        (8, 3, "local_world_size 3 must divide world_size 8"),
        (0, None, "world_size"),
    ],
)
def test_a_shape_that_cannot_be_is_refused_saying_why(
    world: int | None, local: int | None, said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        fake_world.shape_of(world, local, None, None, {})


def test_a_sweep_visits_the_ranks_given_a_sample_with_both_ends_or_every_rank() -> None:
    assert fake_world.swept_ranks(8, [3, 5], None, seed=1) == [3, 5]
    sample = fake_world.swept_ranks(4096, None, 5, seed=1)
    assert len(sample) == 5 and sample[0] == 0 and sample[-1] == 4095
    assert sample == fake_world.swept_ranks(4096, None, 5, seed=1)  # the same seed, the same
    assert fake_world.swept_ranks(4, None, None, seed=1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"rank 9 is not in 0\.\.7"):
        fake_world.swept_ranks(8, [9], None, seed=1)


def test_a_fake_world_starts_as_the_rank_asked_and_stops_clean() -> None:
    shape = fake_world.shape_of(4, None, None, None, {})
    world = fake_world.start(shape, 2, {}, "cpu")
    try:
        assert dist.get_rank() == 2 and dist.get_world_size() == 4 and world.rank == 2
        with pytest.raises(RuntimeError, match="already set up"):
            fake_world.start(shape, 0, {}, "cpu")
    finally:
        fake_world.stop()
    assert not dist.is_initialized()


def _sum_of_ranks(rank: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t.item())


def _fails_on_one(rank: int) -> None:
    if rank == 1:
        raise KeyError("missing on rank 1")
    dist.barrier()


def test_thread_ranks_return_every_value_or_name_the_rank_that_failed() -> None:
    assert run_threaded(_sum_of_ranks, 3, timeout=30) == [3.0, 3.0, 3.0]
    with pytest.raises(ThreadedWorldError, match="rank 1 raised KeyError"):
        run_threaded(_fails_on_one, 3, timeout=30)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        run_threaded(_sum_of_ranks, 0, timeout=30)
