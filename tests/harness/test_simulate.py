"""Simulation fixtures: a launch environment, a fake world of thousands, threads as ranks."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest
import rankwise as rw
import torch
import torch.distributed as dist

from harness import ThreadedWorldError
from harness.common.torchrun_env import VARIABLES


def test_launch_env_looks_like_torchrun_and_is_restored(launch_env: Any) -> None:
    env = launch_env(world_size=8, rank=5, local_world_size=4)
    assert env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "1"
    assert set(env) == set(VARIABLES)  # the same builder as launch mode's
    assert all(os.environ[name] == value for name, value in env.items())
    assert os.environ["WORLD_SIZE"] == "8" and os.environ["RANK"] == "5"
    assert rw.is_distributed_launch() and not rw.is_distributed_run()
    with (
        pytest.raises(ValueError, match="launched as one of 8 ranks"),
        rw.distributed_run(device="cpu"),
    ):
        pass


def test_launch_env_was_restored() -> None:
    assert "RANK" not in os.environ and not rw.is_distributed_launch()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"rank": 2}, "rank must be in 0..1"),
        ({"world_size": 6, "local_world_size": 4}, "local_world_size 4 must divide world_size 6"),
    ],
)
def test_launch_env_rejects_impossible_launches(
    launch_env: Any, kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        launch_env(**kwargs)


def test_fake_world_of_4096_ranks(fake_world: Any) -> None:
    fake_world(4096, rank=4095)
    assert (rw.size(), rw.rank(), rw.is_master(), rw.is_distributed_run()) == (
        4096,
        4095,
        False,
        True,
    )
    groups = [dist.new_group(list(range(start, start + 64))) for start in range(0, 4096, 64)]
    mine = rw.DistributedProcessGroup(groups[-1])
    assert (mine.world_size(), mine.rank()) == (64, 63)
    t = torch.ones(2)
    dist.all_reduce(t)  # returns at once: the fake backend moves no data
    assert t.tolist() == [1.0, 1.0]


def test_fake_world_is_gone_after_the_test() -> None:
    assert not dist.is_initialized()


def test_fake_world_refuses_a_second_world(fake_world: Any) -> None:
    fake_world(8)
    with pytest.raises(RuntimeError, match="already set up"):
        fake_world(8)


def _sum_of_ranks(rank: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_threads_as_ranks_move_data(threaded_world: Any) -> None:
    assert threaded_world(_sum_of_ranks, world_size=4) == [6.0] * 4


def _exit_on_rank(rank: int) -> int:
    if rank == 2:
        sys.exit(3)
    return rank


def test_sys_exit_in_a_rank_thread_fails_instead_of_passing(threaded_world: Any) -> None:
    with pytest.raises(ThreadedWorldError, match=r"rank 2 called sys.exit\(3\)"):
        threaded_world(_exit_on_rank, world_size=4)


def _raise_on_rank(rank: int) -> None:
    if rank == 1:
        raise ValueError("thread rank 1 broke")
    dist.barrier()  # peers waiting on rank 1 are woken, not left hanging


def test_an_error_in_a_rank_thread_is_reported_with_the_rank(threaded_world: Any) -> None:
    with pytest.raises(ThreadedWorldError, match="rank 1 raised ValueError: thread rank 1 broke"):
        threaded_world(_raise_on_rank, world_size=3, timeout=20)
    assert not dist.is_initialized()


def _sums(rank: int) -> list[float]:
    out = []
    for step in range(20):
        t = torch.tensor([float(rank + step)])
        dist.all_reduce(t)
        out.append(t.item())
    return out


def test_a_hung_thread_rank_is_bounded_and_never_joins_a_later_world(
    threaded_world: Any,
) -> None:
    late = threading.Event()

    def rank_1_late(rank: int) -> float:
        if rank == 1:
            late.wait(60)  # released below, once this world has given up on it
        return _sum_of_ranks(rank)

    started = time.monotonic()
    with pytest.raises(ThreadedWorldError, match=r"rank 1 hung \(still running after 3 s\)"):
        threaded_world(rank_1_late, world_size=4, timeout=3)
    # One deadline for the call: it waited 3 s for each thread in turn (12 s here).
    assert time.monotonic() - started < 9
    late.set()  # the stale rank 1 wakes into a collective of a world that is gone
    assert (
        threaded_world(_sums, world_size=2, timeout=20)
        == [[float(1 + 2 * step) for step in range(20)]] * 2
    )


def test_a_thread_rank_still_running_from_an_earlier_call_is_named(
    threaded_world: Any,
) -> None:
    stuck = threading.Event()
    with pytest.raises(ThreadedWorldError, match="rank 1 hung"):
        threaded_world(lambda rank: stuck.wait(60) if rank == 1 else None, 2, 0.5)
    try:
        with pytest.raises(RuntimeError, match=r"thread-rank 1 .*test_simulate.py::test_a_thr.*"):
            threaded_world(_sum_of_ranks, world_size=2, timeout=0.5)
    finally:
        stuck.set()
    assert threaded_world(_sum_of_ranks, world_size=2) == [1.0, 1.0]


@pytest.mark.slow
def test_the_downstream_example_uses_only_the_documented_surface(pytester: pytest.Pytester) -> None:
    from pathlib import Path

    example = (
        Path(__file__).resolve().parents[2] / "examples" / "downstream" / "test_my_training.py"
    )
    pytester.makepyfile(test_my_training=example.read_text())
    result = pytester.runpytest_subprocess("-p", "harness", "--ranks", "4", "-v")
    result.assert_outcomes(passed=12)
