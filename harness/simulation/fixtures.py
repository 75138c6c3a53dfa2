"""Simulation fixtures: one process, no ranks. Each says what it cannot simulate.

- ``launch_env``: torchrun's environment, restored after the test.
- ``fake_world``: one rank of a world of any size (torch's "fake" backend), with its mesh,
  nodes and a record of its collectives, for plans and shapes at thousands of ranks.
- ``threaded_world``: threads as ranks over a process group of the harness's own, for fast
  logic tests that move real data.

torch is imported only when a fixture is used; the worlds live in ``harness.simulation``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from harness.common.faults import Fault
from harness.common.torchrun_env import torchrun_env
from harness.simulation import fake_world as fake
from harness.simulation.threaded_world import ThreadedWorldError, ThreadRank, run_threaded

__all__ = ["FakeWorlds", "ThreadRank", "ThreadedWorldError", "fake_world", "launch_env"]


class LaunchEnv:
    """``launch_env(world_size=8, rank=3)``: this process now looks like rank 3 of a launch.

    Sets every variable torchrun sets for its workers (``harness.common.torchrun_env``'s,
    and the per-worker ones: ``TORCHELASTIC_ERROR_FILE`` under the test's tmp_path,
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``OMP_NUM_THREADS`` where a node runs several
    ranks and it is unset), before any process group exists; all restored after the test.
    Cannot simulate: the rendezvous (nothing listens on MASTER_PORT) and the peers.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self._monkeypatch = monkeypatch
        self._tmp_path = tmp_path
        self.asked: dict[str, str] = {}  # what the test's own latest call set

    def __call__(
        self,
        world_size: int = 2,
        rank: int = 0,
        local_world_size: int | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
    ) -> dict[str, str]:
        self.asked = self.apply(world_size, rank, local_world_size, master_addr, master_port)
        return self.asked

    def apply(
        self,
        world_size: int,
        rank: int,
        local_world_size: int | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
    ) -> dict[str, str]:
        """Set the variables (for the test, or for fake_world's rank) and return them."""
        local = local_world_size or world_size
        for name, value in (("world_size", world_size), ("local_world_size", local)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"launch_env: {name} must be an int >= 1; got {value!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
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
        env.update(self._per_worker(rank, local))
        for variable, text in env.items():
            self._monkeypatch.setenv(variable, text)
        return env

    def _per_worker(self, rank: int, local: int) -> dict[str, str]:
        """What torchrun's agent adds for each worker process."""
        error_file = self._tmp_path / "torchelastic" / f"rank{rank}" / "error.json"
        error_file.parent.mkdir(parents=True, exist_ok=True)
        extra = {
            "TORCHELASTIC_ERROR_FILE": str(error_file),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": _environ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
        if local > 1:
            extra["OMP_NUM_THREADS"] = _environ("OMP_NUM_THREADS", "1")
        return extra


def _environ(name: str, default: str) -> str:
    return os.environ.get(name, default)


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> LaunchEnv:
    """``launch_env(world_size=8, rank=3)``: torchrun's environment for rank 3 of 8 (see
    LaunchEnv), restored after the test."""
    return LaunchEnv(monkeypatch, tmp_path)


class FakeWorlds:
    """``fake_world(world_size, rank=0, *, local_world_size=, mesh=, mesh_dim_names=)``.

    Sets up this process as `rank` of a fake world and returns its FakeWorld: the default
    group, the mesh (``init_device_mesh`` with named dimensions) when `mesh` gives its sizes,
    node and local rank, and ``record()`` for the collectives issued. The whole torchrun
    environment of that rank is set too (``launch_env``'s); sizes and rank the call leaves
    out come from what ``launch_env`` set earlier in the test (and must agree with it).
    ``sweep(...)`` yields the same world as each of many ranks in turn. Cannot simulate:
    data movement (torch's fake collectives return at once; rankwise's labelled ones raise
    NotSimulatedError where their result needs the other ranks' data), other ranks' views,
    failures and hangs.
    """

    def __init__(self, env: LaunchEnv) -> None:
        self._env = env

    def __call__(
        self,
        world_size: int | None = None,
        rank: int | None = None,
        *,
        local_world_size: int | None = None,
        mesh: Sequence[int] | None = None,
        mesh_dim_names: Sequence[str] | None = None,
        device_type: str = "cpu",
    ) -> fake.FakeWorld:
        asked = self._env.asked
        shape = fake.shape_of(world_size, local_world_size, mesh, mesh_dim_names, asked)
        return self._start(shape, fake.rank_of(shape, rank, asked), device_type)

    def sweep(
        self,
        world_size: int | None = None,
        *,
        ranks: Sequence[int] | None = None,
        sample: int | None = None,
        seed: int = 0,
        local_world_size: int | None = None,
        mesh: Sequence[int] | None = None,
        mesh_dim_names: Sequence[str] | None = None,
        device_type: str = "cpu",
    ) -> Iterator[fake.FakeWorld]:
        """The same world as each rank in `ranks` (default every rank; `sample=k` picks k,
        the first and last among them) in turn; each torn down before the next starts."""
        asked = self._env.asked
        shape = fake.shape_of(world_size, local_world_size, mesh, mesh_dim_names, asked)
        for at in fake.swept_ranks(shape.world_size, ranks, sample, seed):
            world = self._start(shape, at, device_type)
            try:
                yield world
            finally:
                fake.stop()

    def _start(self, shape: fake.Shape, rank: int, device_type: str) -> fake.FakeWorld:
        env = self._env.apply(shape.world_size, rank, shape.local_world_size)
        return fake.start(shape, rank, env, device_type)


@pytest.fixture
def fake_world(launch_env: LaunchEnv) -> Iterator[FakeWorlds]:
    """One rank of a world of any size, in-process (see FakeWorlds); torn down after."""
    yield FakeWorlds(launch_env)
    fake.stop()


@pytest.fixture
def threaded_world() -> Callable[..., list[Any]]:
    """``threaded_world(fn, world_size=4, timeout=30, faults=())``: ``fn(rank)`` on
    thread-ranks, every rank's value returned in rank order.

    Each thread joins a process group of the harness's own: collectives and send/recv move
    real data between the threads (rankwise's gathers too), and ranks that meet in different
    collectives raise. If any rank raised, called sys.exit (which a thread would otherwise
    swallow) or hung, raises ThreadedWorldError: the origin first (the rank rankwise's
    errors name, else the first to fail), the ranks woken by its failure as collateral, every
    rank's record in ``.ranks``. ``faults`` are Fault objects fired per thread-rank at named
    points (raise, exit, hang, delay). A skip on every rank skips the test.
    Cannot simulate: NCCL or CUDA collectives, separate processes (module state, the RNG and
    the environment are shared by all ranks), crashes or signals; a thread-rank hung in its
    own code cannot be killed (it is left as a daemon, and a later call waits up to its
    timeout for it to end, else raises naming it).
    """

    def run(
        fn: Callable[[int], Any],
        world_size: int = 4,
        timeout: float = 30.0,
        faults: Sequence[Fault] = (),
    ) -> list[Any]:
        return run_threaded(fn, world_size, timeout, faults)

    return run
