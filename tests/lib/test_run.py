"""distributed_run, every sentence of the spec, on CPU with gloo (the CUDA launch is GPU-marked)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import rankwise as rw
import torch
import torch.distributed as dist
from rankwise._run import ABORT_EXIT_CODE

from harness import Ending


@contextlib.contextmanager
def _no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---- a single process -----------------------------------------------------------------------


def test_a_single_process_sets_nothing_up() -> None:
    with _no_warnings(), rw.distributed_run(timeout=timedelta(seconds=5), device="cpu") as state:
        assert state == rw.DistributedState(rank=0, world_size=1, device=torch.device("cpu"))
        assert state.is_main
        assert not dist.is_initialized()
    assert not dist.is_initialized()


def test_cuda_on_a_machine_without_it_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with (
        pytest.raises(RuntimeError, match=r"CUDA is not available.*pass device='cpu'"),
        rw.distributed_run(),
    ):
        pass


@pytest.mark.parametrize(("device", "error"), [("tpu9", ValueError), (3.5, TypeError)])
def test_a_bad_device_is_a_clear_error(device: Any, error: type) -> None:
    with pytest.raises(error, match="device"), rw.distributed_run(device=device):
        pass


def test_a_bad_timeout_is_a_clear_error() -> None:
    bad: Any = 30
    with pytest.raises(TypeError, match="timedelta"), rw.distributed_run(timeout=bad, device="cpu"):
        pass


def _one_rank_group(path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def test_a_group_the_body_sets_up_is_destroyed(tmp_path: Path) -> None:
    with rw.distributed_run(device="cpu"):
        _one_rank_group(tmp_path / "store")
        assert rw.is_initialized()
    assert not dist.is_initialized()


def _state_follows_the_group_the_body_sets_up(index: int, path: str) -> None:
    with rw.distributed_run(device="cpu") as state:
        assert (state.rank, state.world_size, state.is_main) == (0, 1, True)  # one process
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=index, world_size=2)
        assert (state.rank, state.world_size, state.is_main) == (index, 2, index == 0)
    assert not dist.is_initialized()


def test_the_state_reads_the_live_group_the_body_set_up(tmp_path: Path) -> None:
    import harness

    harness.spawn(
        _state_follows_the_group_the_body_sets_up, args=(str(tmp_path / "store"),), nprocs=2
    )


def test_a_one_rank_group_the_body_set_up_is_destroyed_when_it_raises(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="oops"), rw.distributed_run(device="cpu"):
        _one_rank_group(tmp_path / "store")
        raise KeyError("oops")
    assert not dist.is_initialized()


def test_malformed_world_size_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "many")
    with pytest.raises(ValueError, match="WORLD_SIZE='many'"), rw.distributed_run(device="cpu"):
        pass


# ---- a caller's group -----------------------------------------------------------------------


@pytest.mark.ranks(4)
def test_a_callers_group_is_used_and_left_alone(rank: int) -> None:
    with _no_warnings(), rw.distributed_run(device="cpu") as state:
        assert (state.rank, state.world_size, state.is_main) == (rank, 4, rank == 0)
        assert rw.all_reduce("sum", lambda: rank, sum) == 6
    assert dist.is_initialized()  # the caller's: not destroyed
    dist.barrier()


@pytest.mark.ranks(4)
def test_a_timeout_for_a_callers_group_of_several_warns(rank: int) -> None:
    expected = r"timeout=0:00:05 is ignored.*4 ranks"
    with (
        pytest.warns(RuntimeWarning, match=expected),
        rw.distributed_run(timeout=timedelta(seconds=5), device="cpu"),
    ):
        pass


def _run_with_timeout_in_callers_group() -> tuple[int, int, bool]:
    with _no_warnings(), rw.distributed_run(timeout=timedelta(seconds=5), device="cpu") as s:
        pass
    return s.rank, s.world_size, dist.is_initialized()


def test_a_timeout_in_a_callers_one_rank_group_is_silently_unused(run_on_ranks: Any) -> None:
    assert run_on_ranks(_run_with_timeout_in_callers_group, world_size=1).values == [(0, 1, True)]


def _raise_on_rank1_in_callers_group() -> bool:
    with rw.distributed_run(device="cpu"):
        if rw.rank() == 1:
            raise ValueError("rank 1's batch is empty")
    return dist.is_initialized()


def test_in_a_callers_group_the_error_goes_to_the_caller(run_on_ranks: Any) -> None:
    out = run_on_ranks(_raise_on_rank1_in_callers_group, world_size=4, timeout=20)
    assert out.endings == [Ending.RETURNED, Ending.RAISED, Ending.RETURNED, Ending.RETURNED]
    assert out[1].exc_name == "ValueError" and "batch is empty" in out[1].message
    assert [out[r].value for r in (0, 2, 3)] == [True, True, True]


# ---- a group the run owns, of several ranks -----------------------------------------------------


def _own_group_then(action: str) -> tuple[int, bool]:
    """A launched rank without the launch's WORLD_SIZE: the body sets its 4-rank group up."""
    world, me = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    del os.environ["WORLD_SIZE"]  # not a launch now: the body owns the group it makes
    try:
        with rw.distributed_run(device="cpu") as state:
            dist.init_process_group("gloo", init_method="env://", rank=me, world_size=world)
            if action == "raise" and me == 1:
                raise ValueError("rank 1 cannot go on")
            if action == "exit":
                sys.exit(7)
    except SystemExit as exc:
        return int(str(exc.code)), dist.is_initialized()
    return state.rank, dist.is_initialized()


def test_a_run_owned_group_is_destroyed_on_exit(run_on_ranks: Any) -> None:
    out = run_on_ranks(_own_group_then, "nothing", world_size=4, launch=True, timeout=30)
    assert out.values == [(r, False) for r in range(4)]  # the state keeps the run's ranks


def _is_main_after_the_block() -> tuple[int, int, bool, bool]:
    world, me = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    del os.environ["WORLD_SIZE"]
    with rw.distributed_run(device="cpu") as state:
        dist.init_process_group("gloo", init_method="env://", rank=me, world_size=world)
        during = hash(state)
        seen = {state}
    # The group is gone: the state must not read rank 0 of 1 now, or every rank is main.
    stable = hash(state) == during and state in seen
    return state.rank, state.world_size, state.is_main, stable


def test_after_the_block_the_state_keeps_the_runs_values(run_on_ranks: Any) -> None:
    """It read rank 0 of 1 once the run had destroyed its group, so `if state.is_main:
    save()` after the block ran on every rank; its hash changed as well."""
    out = run_on_ranks(_is_main_after_the_block, world_size=3, launch=True, timeout=30)
    assert out.values == [(0, 3, True, True), (1, 3, False, True), (2, 3, False, True)]


def test_a_group_the_body_set_up_after_destroying_the_callers_is_destroyed(
    tmp_path: Path,
) -> None:
    """The spec: the run destroys a group the body set up; only one that was there when the
    run began is the caller's. The body's replacement of the caller's outlived the run."""
    _one_rank_group(tmp_path / "callers")
    with rw.distributed_run(device="cpu"):
        dist.destroy_process_group()
        _one_rank_group(tmp_path / "bodys")
    assert not dist.is_initialized()


def test_a_rank_whose_body_raised_in_a_run_owned_group_aborts(run_on_ranks: Any) -> None:
    out = run_on_ranks(_own_group_then, "raise", world_size=4, launch=True, timeout=30)
    assert out[1].ending is Ending.HARD_EXIT and out[1].exit_code == ABORT_EXIT_CODE
    assert "rankwise: rank 1 of 4 aborting the run" in out[1].output
    assert "ValueError: rank 1 cannot go on" in out[1].output  # the traceback, printed first
    for r in (0, 2, 3):  # they wait for every rank at the end, and learn rank 1 left
        assert out[r].ending is Ending.RAISED
        assert f"rank {r} of 4 finished its run, but waiting for every rank" in out[r].message


def test_a_system_exit_tears_down_normally(run_on_ranks: Any) -> None:
    out = run_on_ranks(_own_group_then, "exit", world_size=4, launch=True, timeout=30)
    assert out.values == [(7, False)] * 4


def _rank_1_exits_alone() -> int | None:
    """Rank 1 exits with code 2 while its peers go on to a collective (3 s group timeout)."""
    world, me = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    del os.environ["WORLD_SIZE"]
    try:
        with rw.distributed_run(device="cpu"):
            dist.init_process_group(
                "gloo", init_method="env://", rank=me, world_size=world,
                timeout=timedelta(seconds=3),
            )  # fmt: skip
            if me == 1:
                sys.exit(2)
            rw.all_reduce("after", lambda: me, sum)
    except SystemExit as exc:
        return int(str(exc.code))
    return None


def test_a_rank_that_exits_alone_keeps_its_exit_code_and_is_told_why_it_waited(
    run_on_ranks: Any,
) -> None:
    # The spec: it waits in the teardown until the group times out. Its exit stays its own
    # (code 2), not a RuntimeError saying it "finished its run" and blaming a peer.
    out = run_on_ranks(_rank_1_exits_alone, world_size=3, launch=True, timeout=60)
    assert out[1].ending is Ending.RETURNED and out[1].value == 2, out.report()
    assert "rank 1 of 3 exited alone (SystemExit(2))" in out[1].output, out[1].output


# ---- a launch (torchrun's environment, no group yet) ----------------------------------------


def _run_launched(device: str) -> None:
    with rw.distributed_run(device=device):
        pass


def test_a_launch_refuses_a_cpu_device(run_on_ranks: Any) -> None:
    out = run_on_ranks(_run_launched, "cpu", world_size=2, launch=True, timeout=20)
    assert out.endings == [Ending.RAISED, Ending.RAISED]
    assert out[0].exc_name == "ValueError"
    assert "launched as one of 2 ranks" in out[0].message and "'cpu' is refused" in out[0].message


def test_a_launch_without_gpus_says_so(run_on_ranks: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = run_on_ranks(_run_launched, "cuda", world_size=2, launch=True, timeout=20)
    assert out.endings == [Ending.RAISED, Ending.RAISED]
    assert "CUDA is not available on this machine" in out[1].message


def _launched_on_gpus() -> tuple[int, int, str, str, bool]:
    with rw.distributed_run(timeout=timedelta(seconds=60)) as state:
        total = rw.all_reduce("sum", lambda: torch.ones(1, device=state.device), sum)
        backend = rw.backend()
    return (
        state.rank,
        state.world_size,
        str(state.device),
        f"{backend}:{total.item()}",
        (dist.is_initialized()),
    )


@pytest.mark.gpu
def test_a_launch_binds_cuda_and_sets_nccl_up(run_on_ranks: Any) -> None:
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"a launch needs 2 ranks, one GPU each; this machine has {count} GPU")
    out = run_on_ranks(_launched_on_gpus, world_size=count, launch=True, timeout=120)
    assert out.values == [
        (r, count, f"cuda:{r}", f"nccl:{float(count)}", False) for r in range(count)
    ]


# ---- a normal exit waits for every rank; a launch's CUDA index is this rank's ----------------


def _leave_while_rank0_works(shared: str) -> bool:
    """Rank 0's body waits (bounded) for rank 1 to have left its run, then finishes.

    Returns, on rank 1, whether rank 0's body had finished when rank 1 left its run.
    """
    import time

    world, me = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    del os.environ["WORLD_SIZE"]  # not a launch now: the body owns the group it makes
    left, done = Path(shared, "rank1-left"), Path(shared, "rank0-done")
    with rw.distributed_run(device="cpu"):
        dist.init_process_group("gloo", init_method="env://", rank=me, world_size=world)
        if me == 0:
            deadline = time.monotonic() + 1.0  # a rank 1 that waits never gets there
            while not left.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            done.touch()
    finished = done.exists()
    if me == 1:
        left.touch()
    return finished


def test_a_normal_exit_waits_for_every_rank_before_leaving(
    run_on_ranks: Any, tmp_path: Path
) -> None:
    out = run_on_ranks(
        _leave_while_rank0_works, str(tmp_path), world_size=2, launch=True, timeout=30
    )
    assert out.values == [True, True]  # rank 1 left only after rank 0's body was done


def test_a_launch_refuses_a_cuda_device_that_is_not_this_ranks(launch_env: Any) -> None:
    launch_env(world_size=2, rank=0)
    with (
        pytest.raises(ValueError, match=r"'cuda:1' is refused.*LOCAL_RANK=0.*cuda:0"),
        rw.distributed_run(device="cuda:1"),
    ):
        pass
