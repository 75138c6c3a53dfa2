"""The thread-ranks' process group, tested directly on threads of this process (no
torch.distributed session, no process): a collective is a meeting of the group's ranks that
the last to arrive completes, a rank calling another collective fails every rank of the
meeting naming each rank's call, and an aborted world wakes every rank still waiting."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.simulation import thread_group
from harness.simulation.thread_group import CollectiveMismatch, PeerFailed, ThreadWorld
from tests.harness.conftest import wait_until

pytestmark = pytest.mark.unit


def _on_ranks(world: ThreadWorld, size: int, body: Callable[[Any, int], Any]) -> list[Any]:
    """`body(group, rank)` on a thread per rank, each with its own member of group "g";
    what each returned or raised."""
    found: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            found[rank] = body(thread_group.ThreadGroup(world, rank, list(range(size)), "g"), rank)
        except Exception as exc:
            found[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a thread-rank never returned"
    return found


def test_a_collective_completes_when_the_last_rank_arrives() -> None:
    def body(group: Any, rank: int) -> float:
        t = torch.tensor([float(rank + 1)])
        group.allreduce([t]).wait()
        return float(t.item())

    assert _on_ranks(ThreadWorld(), 3, body) == [6.0, 6.0, 6.0]


def test_a_rank_calling_another_collective_fails_every_rank_naming_each_call() -> None:
    def body(group: Any, rank: int) -> None:
        t = torch.ones(2)
        if rank == 2:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([t], options).wait()
        else:
            group.allreduce([t]).wait()

    found = _on_ranks(ThreadWorld(), 3, body)
    assert all(isinstance(e, CollectiveMismatch) for e in found), found
    assert str(found[0]) == str(found[2])
    assert "rank 0: all_reduce(SUM, float32[2]); rank 1: all_reduce(SUM, float32[2]); " in str(
        found[0]
    )
    assert "rank 2: broadcast(root 0, float32[2])" in str(found[0])


def test_an_aborted_world_wakes_every_rank_still_waiting() -> None:
    world = ThreadWorld()

    def body(group: Any, rank: int) -> None:
        if rank == 2:  # never comes: the world is aborted while the others wait
            wait_until(lambda: _arrived(world) == 2, 20, "two ranks waiting in the meeting")
            world.abort("rank 2 raised ValueError: broke")
            return
        group.allreduce([torch.ones(1)]).wait()

    found = _on_ranks(world, 3, body)
    assert [type(e) for e in found[:2]] == [PeerFailed, PeerFailed]
    assert "rank 2 raised ValueError: broke" in str(found[0])


def _arrived(world: ThreadWorld) -> int:
    with world.lock:
        return sum(m.arrived for m in world.meetings.values())
