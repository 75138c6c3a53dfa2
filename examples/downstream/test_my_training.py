"""A downstream project's multi-rank tests, written only with the harness's documented surface.

Run: pytest -p harness --ranks 4 examples/downstream
"""

import os
import signal

import pytest
import rankwise as rw
import torch
import torch.distributed as dist

from harness import (
    Ending,
    Fault,
    aborts,
    assert_close_across_ranks,
    exits,
    fault_point,
    killed,
    raises,
    returns,
)


def train_step(rank: int) -> torch.Tensor:
    """The code under test: a data-parallel step with a named point a test can hook."""
    fault_point("load_batch")
    grad = torch.full((4,), float(rank + 1))
    dist.all_reduce(grad)
    return grad / dist.get_world_size()


@pytest.mark.ranks(2, 4)
def test_gradients_agree_on_every_rank(rank: int, world_size: int) -> None:
    grad = train_step(rank)
    assert_close_across_ranks(grad)
    assert grad[0].item() == (world_size + 1) / 2


@pytest.mark.ranks(4)
@pytest.mark.fault(rank=2, kind="raise", exc=OSError("disk full"), at="load_batch")
@pytest.mark.expect(rank=2, does=raises(OSError, match="disk full"), others=raises(RuntimeError))
def test_a_failing_loader_stops_every_rank(rank: int) -> None:
    train_step(rank)


@pytest.mark.ranks(4)
@pytest.mark.fault(rank=1, kind="signal", signal="SIGKILL", at="load_batch")
@pytest.mark.expect(
    {
        1: killed(signal.SIGKILL),
        0: raises(RuntimeError),
        2: raises(RuntimeError),
        3: raises(RuntimeError),
    }
)
def test_a_killed_rank_is_reported(rank: int) -> None:
    train_step(rank)


@pytest.mark.ranks(4)
@pytest.mark.expect(exits(3))
def test_a_labelled_collective_exits_together(rank: int) -> None:
    rw.all_reduce("batch_size", lambda: rank if rank != 0 else exit(3), min)


def _run_and_fail_on_rank1() -> None:
    with rw.distributed_run(device="cpu"):
        if rw.rank() == 1:
            raise ValueError("bad shard")


def test_outcomes_from_the_outside(run_on_ranks) -> None:  # type: ignore[no-untyped-def]
    out = run_on_ranks(_run_and_fail_on_rank1, world_size=3, timeout=20)
    out.expect(rank=1, does=raises(ValueError, match="bad shard"), others=returns())
    assert out[0].ending is Ending.RETURNED
    faulted = run_on_ranks(train_step, 0, world_size=2, faults=[Fault(rank=0, kind="exit", code=5)])
    faulted.expect(rank=0, does=exits(5), others=raises(RuntimeError))


def test_aborts_is_part_of_the_surface() -> None:
    assert aborts().describe().startswith("aborts")


def test_plans_at_scale_in_one_process(fake_world) -> None:  # type: ignore[no-untyped-def]
    fake_world(4096)
    assert rw.size() == 4096 and rw.is_distributed_run()


def test_parse_time_launch_detection(launch_env) -> None:  # type: ignore[no-untyped-def]
    launch_env(world_size=8, rank=3)
    assert rw.is_distributed_launch()


def test_threads_as_ranks(threaded_world) -> None:  # type: ignore[no-untyped-def]
    assert threaded_world(lambda rank: rank * 2, world_size=3) == [0, 2, 4]


# ---- pytest's own fixtures work in rank tests -------------------------------------------


@pytest.fixture(params=[2, 8])
def batch(request: pytest.FixtureRequest) -> int:
    """A parametrized fixture: resolved in the pytest process, its value sent to every rank."""
    return int(request.param)


@pytest.mark.ranks(2)
def test_logs_prints_and_files_are_per_rank(
    rank: int,
    batch: int,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tmp_path: "os.PathLike[str]",
    request: pytest.FixtureRequest,
) -> None:
    import logging
    from pathlib import Path

    with caplog.at_level(logging.INFO):
        logging.getLogger("train").info("rank %d: batch %d", rank, batch)
    print(f"checkpoint for rank {rank}")
    assert caplog.messages == [f"rank {rank}: batch {batch}"]
    assert capsys.readouterr().out == f"checkpoint for rank {rank}\n"
    (Path(tmp_path) / "ckpt.pt").write_bytes(b"x" * batch)  # each rank's own directory
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["ckpt.pt"]
    assert request.node.name == f"test_logs_prints_and_files_are_per_rank[{batch}-ranks2]"
