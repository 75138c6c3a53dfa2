"""Simulation fixtures: one process, no ranks. Each says what it cannot simulate.

- ``launch_env``: torchrun's environment, restored after the test.
- ``fake_world``: a process group of any size (torch's "fake" backend), for plans and rank
  arithmetic at thousands of ranks.
- ``threaded_world``: threads as ranks (torch's "threaded" backend), for fast logic tests.

torch is imported only when a fixture is used.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from harness.common.outcome import Ending, exit_code
from harness.common.torchrun_env import torchrun_env


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict[str, str]]:
    """``launch_env(world_size=8, rank=3)``: this process now looks like rank 3 of a launch.

    Sets every variable torchrun sets for its workers (``harness.common.torchrun_env.VARIABLES``:
    WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...), before any process group
    exists, and restores them after the test.
    Cannot simulate: the rendezvous (nothing listens on MASTER_PORT, so setting a group up
    from this environment fails) and the peers themselves.
    """

    def set_up(
        world_size: int = 2,
        rank: int = 0,
        local_world_size: int | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
    ) -> dict[str, str]:
        local = local_world_size or world_size
        for name, value in (("world_size", world_size), ("local_world_size", local)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"launch_env: {name} must be an int >= 1; got {value!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"launch_env: rank must be in 0..{world_size - 1}; got {rank!r}")
        if world_size % local:
            raise ValueError(
                f"launch_env: local_world_size {local} must divide world_size {world_size}"
            )
        env = torchrun_env(
            world_size,
            rank,
            master_addr=master_addr,
            master_port=master_port,
            local_world_size=local,
        )
        for variable, text in env.items():
            monkeypatch.setenv(variable, text)
        return env

    return set_up


@pytest.fixture
def fake_world() -> Iterator[Callable[..., Any]]:
    """``fake_world(world_size=4096, rank=0)``: a live default group of any size, in-process.

    Queries (rank, world size, new_group, the group's ranks) behave as in a real world of that
    size, so plans and rank arithmetic can be tested at scale. The group is destroyed after
    the test. Cannot simulate: data movement (collectives return at once and leave tensors
    as they were), other ranks' views, failures and hangs.
    """
    import torch.distributed as dist

    owned: list[bool] = []

    def set_up(world_size: int, rank: int = 0) -> Any:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError("fake_world: a process group is already set up in this process")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"fake_world: world_size must be an int >= 1; got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"fake_world: rank must be in 0..{world_size - 1}; got {rank!r}")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        owned.append(True)
        return dist.group.WORLD

    yield set_up
    if owned and dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class ThreadRank:
    """How one thread-rank ended."""

    rank: int
    ending: Ending
    value: Any = None
    error: BaseException | None = None
    exit_code: int | None = None
    collateral: bool = False  # woken from a collective because another rank failed


class ThreadedWorldError(AssertionError):
    """A thread-rank did not return: raised, called sys.exit, or hung."""


@pytest.fixture
def threaded_world() -> Callable[..., list[Any]]:
    """``threaded_world(fn, world_size=4, timeout=30)``: run ``fn(rank)`` on thread-ranks.

    Each thread joins a "threaded" process group; collectives really move data between the
    threads. Returns every rank's value; if any rank raised, called sys.exit (which a
    thread would otherwise swallow) or hung, raises ThreadedWorldError naming each rank.
    Cannot simulate: NCCL or CUDA collectives, separate processes (module state, the RNG and
    the environment are shared by all ranks: torch.manual_seed on one rank seeds them all),
    crashes or signals, and a hung thread cannot be killed (it is left as a daemon, and a
    later call waits up to its timeout for it to end, else raises naming it).
    """

    def run(fn: Callable[[int], Any], world_size: int = 4, timeout: float = 30.0) -> list[Any]:
        return _run_threaded(fn, world_size, timeout)

    return run


def _run_threaded(fn: Callable[[int], Any], world_size: int, timeout: float) -> list[Any]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    # torch's private threaded-backend helpers, untyped: reach them through Any.
    threaded: Any = multi_threaded_pg
    ProcessLocalGroup = threaded.ProcessLocalGroup

    if dist.is_initialized():
        raise RuntimeError("threaded_world: a process group is already set up in this process")
    _wait_for_stale_ranks(timeout)
    ProcessLocalGroup.reset()  # a stale rank that ended may have flagged its old world's end
    world = threaded._install_threaded_pg()
    c10d: Any = torch._C._distributed_c10d
    c10d._set_thread_isolation_mode(True)  # each thread-rank registers its own group names
    store = dist.HashStore()  # type: ignore[attr-defined]
    ends: dict[int, ThreadRank] = {}

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            ends[rank] = ThreadRank(rank, Ending.RETURNED, value=fn(rank))
        except SystemExit as exc:
            if exc.code == _WOKEN_BY_PEER:  # torch ends a waiting peer so when a rank fails
                ends[rank] = ThreadRank(rank, Ending.RAISED, error=exc, collateral=True)
                return
            ends[rank] = ThreadRank(rank, Ending.EXITED, error=exc, exit_code=exit_code(exc))
            ProcessLocalGroup.exception_handle(exc)  # wake the peers waiting on this rank
        except BaseException as exc:
            ends[rank] = ThreadRank(rank, Ending.RAISED, error=exc)
            ProcessLocalGroup.exception_handle(exc)
        finally:
            if dist.distributed_c10d._world is world and dist.is_initialized():
                dist.destroy_process_group()

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"thread-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    try:
        for thread in threads:
            thread.start()
        _join_all(threads, time.monotonic() + timeout)
        if any(thread.is_alive() for thread in threads):
            # Wake the thread-ranks waiting in a collective on a hung one: they end as
            # collateral; those hung in their own code stay, and a later call waits for them.
            ProcessLocalGroup.exception_handle(TimeoutError("a thread-rank hung"))
            _join_all(threads, time.monotonic() + WAKE_S)
    finally:
        c10d._set_thread_isolation_mode(False)
        threaded._uninstall_threaded_pg()
        ProcessLocalGroup.reset()
    origin = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0] or "an earlier call"
    _stale.extend((r, thread, origin) for r, thread in enumerate(threads) if thread.is_alive())
    for rank in range(world_size):
        ends.setdefault(rank, ThreadRank(rank, Ending.HUNG))
    _raise_unless_all_returned([ends[r] for r in range(world_size)], timeout)
    return [ends[r].value for r in range(world_size)]


_WOKEN_BY_PEER = "Test termination event occurs."
WAKE_S = 1.0  # how long thread-ranks woken after a hang get to end
# Thread-ranks a call gave up on that were still running (rank, thread, the test that made
# them): a thread cannot be killed, and one that went on into a collective would take part in
# a later call's world.
_stale: list[tuple[int, threading.Thread, str]] = []


def _join_all(threads: list[threading.Thread], deadline: float) -> None:
    """Join every thread by one deadline (not the bound once per thread)."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _wait_for_stale_ranks(timeout: float) -> None:
    """Start a world only once every stale thread-rank has ended, waiting up to `timeout`;
    else raise, naming them and the test that left them."""
    _join_all([thread for _, thread, _ in _stale], time.monotonic() + timeout)
    _stale[:] = [entry for entry in _stale if entry[1].is_alive()]
    if _stale:
        ranks = ", ".join(f"thread-rank {rank} of {origin}" for rank, _, origin in _stale)
        raise RuntimeError(
            f"threaded_world: {ranks} still running {timeout:g} s into this call; a thread "
            f"cannot be killed, and it would take part in this world's collectives: end the "
            f"hang in that test (this call starts once it has ended)"
        )


def _raise_unless_all_returned(ends: list[ThreadRank], timeout: float) -> None:
    bad = [end for end in ends if end.ending is not Ending.RETURNED]
    if not bad:
        return
    parts = []
    woken = [end.rank for end in bad if end.collateral]
    bad = [end for end in bad if not end.collateral] or bad
    for end in bad:
        if end.ending is Ending.EXITED:
            parts.append(f"rank {end.rank} called sys.exit({end.exit_code})")
        elif end.ending is Ending.RAISED:
            parts.append(f"rank {end.rank} raised {type(end.error).__name__}: {end.error}")
        else:
            parts.append(f"rank {end.rank} hung (still running after {timeout:g} s)")
    if woken and len(bad) < len(ends):
        parts.append(
            f"{'rank' if len(woken) == 1 else 'ranks'} {', '.join(map(str, woken))} collateral"
        )
    error = ThreadedWorldError("threaded_world: " + "; ".join(parts))
    first = next((end.error for end in bad if end.error is not None), None)
    if first is not None:
        raise error from first
    raise error
