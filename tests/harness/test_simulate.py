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

from harness import Fault, ThreadedWorldError, fault_point
from harness.common.torchrun_env import VARIABLES


def test_launch_env_looks_like_torchrun_and_is_restored(launch_env: Any) -> None:
    env = launch_env(world_size=8, rank=5, local_world_size=4)
    assert env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "1"
    # The same builder as launch mode's, and what torchrun's agent adds for each worker.
    assert set(env) == set(VARIABLES) | {
        "TORCHELASTIC_ERROR_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "OMP_NUM_THREADS",
    }
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


# ---- launch_env: every variable torchrun's agent sets --------------------------------------


@pytest.mark.parametrize("local", [1, 4])
def test_launch_env_sets_the_per_worker_variables(
    launch_env: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, local: int
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    env = launch_env(world_size=8, rank=6, local_world_size=local)
    error_file = os.environ["TORCHELASTIC_ERROR_FILE"]
    assert env["TORCHELASTIC_ERROR_FILE"] == error_file
    assert error_file.startswith(str(tmp_path)) and os.path.isdir(os.path.dirname(error_file))
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # torchrun sets OMP_NUM_THREADS=1 only where a node runs several workers
    assert os.environ.get("OMP_NUM_THREADS") == ("1" if local > 1 else None)


def test_launch_env_keeps_the_users_own_thread_count(
    launch_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    launch_env(world_size=4, rank=1)
    assert os.environ["OMP_NUM_THREADS"] == "3"


def test_rankwise_errors_reach_the_simulated_error_file(launch_env: Any) -> None:
    from rankwise.testing import write_launcher_error

    launch_env(world_size=4, rank=2)
    write_launcher_error(message="ValueError: bad batch", callstack="...", timestamp=1)
    with open(os.environ["TORCHELASTIC_ERROR_FILE"]) as file:
        assert "bad batch" in file.read()


# ---- threaded_world: blame, records, faults, gathers, skips, mismatches ---------------------


def _fails_on_rank_2_inside_all_reduce(rank: int) -> int:
    return rw.all_reduce("v", lambda: 1 // (rank - 2), sum)  # rank 2 divides by zero


@pytest.mark.parametrize("run", range(5))
def test_threaded_world_names_the_origin_first_every_time(threaded_world: Any, run: int) -> None:
    with pytest.raises(ThreadedWorldError) as caught:
        threaded_world(_fails_on_rank_2_inside_all_reduce, world_size=4)
    error = caught.value
    assert str(error).startswith(
        "threaded_world: rank 2 raised ZeroDivisionError: integer division or modulo by zero "
        "[origin]; ranks 0, 1, 3 collateral (failed because rank 2 did)"
    )
    assert error.origin == 2 and error.origin_rank == 2
    assert [r.rank for r in error.ranks] == [0, 1, 2, 3]
    assert [r.collateral for r in error.ranks] == [True, True, False, True]
    assert isinstance(error.ranks[2].error, ZeroDivisionError)
    assert all("rank 2 raised ZeroDivisionError" in str(error.ranks[r].error) for r in (0, 1, 3))
    assert isinstance(error.__cause__, ZeroDivisionError)


def _raise_then_peers_wait(rank: int) -> None:
    if rank == 3:
        raise KeyError("missing shard")
    t = torch.ones(1)
    dist.all_reduce(t)  # the others wait for rank 3, and are woken when it fails


def test_ranks_woken_by_a_failure_are_collateral_and_the_failure_is_named(
    threaded_world: Any,
) -> None:
    with pytest.raises(ThreadedWorldError) as caught:
        threaded_world(_raise_then_peers_wait, world_size=4, timeout=20)
    assert str(caught.value).startswith("threaded_world: rank 3 raised KeyError: 'missing shard'")
    assert caught.value.origin == 3
    assert [r.collateral for r in caught.value.ranks] == [True, True, True, False]


def _gathers(rank: int) -> tuple[Any, ...]:
    data = bytes([rank]) * (rank + 1)
    gathered = rw.gather_bytes(data, dst=1, chunk_bytes=2)
    states = list(rw.gather_state_dicts({"w": torch.full((2,), float(rank))}, dst=0))
    big = rw.broadcast_from("big", lambda: torch.arange(5000.0) + rank, src=2)  # past a header
    t = torch.zeros(1)
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=3)
    elif rank == 3:
        dist.recv(t, src=0)
    return gathered, [s["w"].tolist() for s in states], big[:2].tolist(), t.item()


def test_thread_ranks_gather_and_move_point_to_point(threaded_world: Any) -> None:
    results = threaded_world(_gathers, world_size=4)
    assert results[1][0] == [bytes([r]) * (r + 1) for r in range(4)]
    assert all(results[r][0] is None for r in (0, 2, 3))
    assert results[0][1] == [[float(r)] * 2 for r in range(4)]
    assert all(results[r][1] == [] for r in (1, 2, 3))
    assert all(result[2] == [2.0, 3.0] for result in results)
    assert results[3][3] == 42.0


# torch 2.13's names for all_gather_into_tensor and reduce_scatter_tensor (older: only those)
_all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single: Any = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def _every_torch_collective(rank: int) -> dict[str, Any]:
    n = dist.get_world_size()
    out: dict[str, Any] = {}
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = t.item()
    gathered = [torch.zeros(1) for _ in range(n)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    out["all_gather"] = [g.item() for g in gathered]
    whole = torch.zeros(n)
    _all_gather_single(whole, torch.tensor([float(rank)]))
    out["all_gather_into_tensor"] = whole.tolist()
    swapped = torch.zeros(n)
    dist.all_to_all_single(swapped, torch.arange(float(n)) + 10 * rank)
    out["all_to_all_single"] = swapped.tolist()
    piece = torch.zeros(1)
    _reduce_scatter_single(piece, torch.arange(float(n)))
    out["reduce_scatter_tensor"] = piece.item()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=n - 1)
    out["broadcast"] = b.item()
    objects: list[Any] = [None] * n
    dist.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"] = objects
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        s = torch.ones(1)
        dist.all_reduce(s, group=sub)
        out["subgroup"] = s.item()
    dist.barrier()
    return out


def test_thread_ranks_run_torch_collectives_on_the_world_and_subgroups(
    threaded_world: Any,
) -> None:
    results = threaded_world(_every_torch_collective, world_size=3)
    for rank, out in enumerate(results):
        assert out["max"] == 2.0
        assert out["all_gather"] == out["all_gather_into_tensor"] == [0.0, 1.0, 2.0]
        assert out["all_to_all_single"] == [float(rank + 10 * src) for src in range(3)]
        assert out["reduce_scatter_tensor"] == 3.0 * rank
        assert out["broadcast"] == 2.0
        assert out["all_gather_object"] == [{"rank": r} for r in range(3)]
        assert out.get("subgroup") == (2.0 if rank < 2 else None)


def _broadcast_on_rank_1(rank: int) -> None:
    t = torch.ones(1)
    if rank == 1:
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)


def test_mismatched_collectives_raise_on_every_rank_naming_the_odd_one(
    threaded_world: Any,
) -> None:
    with pytest.raises(ThreadedWorldError) as caught:
        threaded_world(_broadcast_on_rank_1, world_size=3)
    error = caught.value
    assert error.origin == 1
    assert str(error).startswith("threaded_world: rank 1 raised CollectiveMismatch")
    assert "rank 0: all_reduce(SUM, float32[1]); rank 1: broadcast(root 0, float32[1])" in str(
        error
    )
    assert [r.collateral for r in error.ranks] == [True, False, True]


def _skip_everywhere(rank: int) -> None:
    pytest.skip("needs a GPU")


def test_a_skip_on_every_thread_rank_skips(threaded_world: Any) -> None:
    with pytest.raises(pytest.skip.Exception, match="needs a GPU"):
        threaded_world(_skip_everywhere, world_size=3)


def _skip_on_rank_0(rank: int) -> None:
    if rank == 0:
        pytest.skip("only on rank 0")
    dist.barrier()


def test_a_skip_on_some_thread_ranks_fails_naming_them(threaded_world: Any) -> None:
    with pytest.raises(ThreadedWorldError, match=r"rank 0 skipped \(only on rank 0\)") as caught:
        threaded_world(_skip_on_rank_0, world_size=3, timeout=20)
    assert "a skip must be on every thread-rank: ranks 0 skipped" in str(caught.value)


def _labelled_step(rank: int) -> int:
    fault_point("load")
    return rw.all_reduce("step", lambda: rank, sum)


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        (Fault(rank=3, kind="raise", at="step", exc=ValueError), "rank 3 raised ValueError"),
        (Fault(rank=1, kind="raise", at="load"), "rank 1 raised RuntimeError: fault injected"),
        (Fault(rank=2, kind="exit", code=4, at="all_reduce:step"), "rank 2 called sys.exit(4)"),
        (Fault(rank=0, kind="hang", at="step"), "rank 0 hung (still running after 2 s)"),
    ],
)
def test_faults_fire_per_thread_rank_at_named_points(
    threaded_world: Any, fault: Fault, said: str
) -> None:
    started = time.monotonic()
    with pytest.raises(ThreadedWorldError) as caught:
        threaded_world(_labelled_step, world_size=4, timeout=2, faults=[fault])
    assert str(caught.value).startswith(f"threaded_world: {said}")
    assert caught.value.origin == fault.rank
    assert time.monotonic() - started < 2 + 2 * 1.0 + 5  # the timeout, the wake, slack
    assert threaded_world(_labelled_step, world_size=4) == [6] * 4  # nothing left behind


def test_a_delay_fault_only_slows_its_thread_rank(threaded_world: Any) -> None:
    fault = Fault(rank=1, kind="delay", seconds=0.1, at="step")
    assert threaded_world(_labelled_step, world_size=3, faults=[fault]) == [3] * 3


@pytest.mark.parametrize("kind", ["signal", "hard_exit"])
def test_faults_that_end_a_process_are_refused_on_thread_ranks(
    threaded_world: Any, kind: str
) -> None:
    with pytest.raises(Exception, match=f"a {kind!r} fault ends the whole process"):
        threaded_world(_labelled_step, world_size=2, faults=[Fault(rank=1, kind=kind)])


def test_a_fault_that_is_never_reached_fails_its_thread_rank(threaded_world: Any) -> None:
    fault = Fault(rank=1, kind="raise", at="no-such-point")
    with pytest.raises(ThreadedWorldError, match="rank 1 raised FaultNotReached"):
        threaded_world(_labelled_step, world_size=2, faults=[fault])


def test_threaded_world_leaves_the_process_as_it_found_it(threaded_world: Any) -> None:
    hook = sys.excepthook
    assert threaded_world(_labelled_step, world_size=2) == [1, 1]
    assert sys.excepthook is hook  # each rank's init_process_group wraps it; put back
    assert not dist.is_initialized()


def test_rankwise_all_reduce_scales_on_thread_ranks(threaded_world: Any) -> None:
    """128 thread-ranks: the header exchange shrinks with the group (no n-squared 4 KiB)."""
    results = threaded_world(lambda rank: rw.all_reduce("n", lambda: rank, sum), 128, 120)
    assert results == [sum(range(128))] * 128


def _dtensor_and_fsdp2(rank: int) -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    spread = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0), Replicate()])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():  # the same model on every rank (thread-ranks share one RNG)
        for parameter in model.parameters():
            parameter.fill_(0.1)
    for layer in model:
        fully_shard(layer, mesh=mesh["dp"])
    model(torch.ones(3, 4) * (rank + 1)).sum().backward()
    grad = model[0].weight.grad.full_tensor()  # type: ignore[union-attr]
    return spread.to_local().tolist(), spread.full_tensor().sum().item(), grad.sum().item()


def test_thread_ranks_run_dtensor_and_fsdp2(threaded_world: Any) -> None:
    results = threaded_world(_dtensor_and_fsdp2, world_size=4, timeout=60)
    assert [r[0] for r in results] == [[[0.0, 1.0], [2.0, 3.0]]] * 2 + [
        [[4.0, 5.0], [6.0, 7.0]]
    ] * 2
    assert all(r[1] == 28.0 for r in results)
    # inputs scaled by rank + 1, gradients averaged over each dp group ([0, 2] and [1, 3])
    grads = [r[2] for r in results]
    assert grads[0] == pytest.approx(grads[2]) and grads[1] == pytest.approx(grads[3])
    assert grads[1] / grads[0] == pytest.approx((2 + 4) / (1 + 3))


def _tensor_sums(rank: int) -> list[float]:
    # 1.6 KB a value: past the header's room in a group of 128, so a second exchange
    values = rw.all_reduce("t", lambda: torch.full((3,), float(rank)), list)
    return [float(v[0]) for v in values]


def test_values_larger_than_a_large_group_s_header_still_travel(threaded_world: Any) -> None:
    results = threaded_world(_tensor_sums, 128, 120)
    assert results == [[float(r) for r in range(128)]] * 128
