"""GPU lane: NCCL and CUDA paths (run with `make gpu` / ci/gpu; skipped without GPUs).

Each test runs on as many ranks as it names and the machine has GPUs for; a world of one
NCCL rank still moves CUDA tensors through every collective below.
"""

from __future__ import annotations

from typing import Any

import pytest
import rankwise as rw
import torch
import torch.distributed as dist
from rankwise import _gather, _transport

pytestmark = pytest.mark.gpu


@pytest.mark.ranks(1, 2, backend="nccl", timeout=120)
def test_the_harness_binds_cuda_rank(rank: int, device: Any) -> None:
    assert device == torch.device("cuda", rank) and torch.cuda.current_device() == rank
    assert dist.get_backend() == "nccl"
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


@pytest.mark.ranks(1, 2, backend="nccl", timeout=120)
def test_byte_transport_over_nccl(rank: int, world_size: int) -> None:
    assert _transport.exchange_device().type == "cuda"
    got = _transport.all_gather_bytes(b"rank%d" % rank)
    assert got == [b"rank%d" % r for r in range(world_size)]
    assert _transport.broadcast_bytes(b"from zero" if rank == 0 else None, 0) == b"from zero"


@pytest.mark.ranks(1, 2, backend="nccl", timeout=120)
def test_chunked_gather_over_nccl(rank: int, world_size: int) -> None:
    payload = bytes(range(256)) * (rank + 1)
    out = _gather._gather_chunks(
        memoryview(payload), [256 * (r + 1) for r in range(world_size)], 0, None, 100
    )
    if rank == 0:
        assert out == [bytearray(bytes(range(256)) * (r + 1)) for r in range(world_size)]
    else:
        assert out is None


def _fails_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("bad on 1")
    return 0


@pytest.mark.ranks(2, backend="nccl", timeout=120)
def test_labelled_collectives_over_nccl(rank: int) -> None:
    total = rw.all_reduce("sum", lambda: torch.ones(2, device="cuda") * rank, sum)
    assert total.device.type == "cpu" and total.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError if rank == 1 else RuntimeError, match="bad on 1"):
        rw.all_reduce("fail", lambda: _fails_on_rank_1(rank), sum)


def test_a_single_process_run_on_cuda() -> None:
    with rw.distributed_run() as state:  # device="cuda" by default
        assert state.device.type == "cuda" and (state.rank, state.world_size) == (0, 1)
        assert not dist.is_initialized()
