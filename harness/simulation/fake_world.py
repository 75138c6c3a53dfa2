"""One rank of a world of any size, in this process: its place, its mesh, its nodes.

A fake world is torch's "fake" backend (collectives return at once and move nothing) with
what a test of a plan needs around it: the whole torchrun environment of the simulated rank
(``launch_env``'s), its node and local rank, an ``init_device_mesh`` mesh with named
dimensions, a record of the collectives issued, and a sweep that sets up the same world as
each of many ranks in turn (every rank of a small plan, a sample of a 4096-rank one).
rankwise's labelled collectives refuse to compute what they cannot know here
(``rankwise.testing.NotSimulatedError``) instead of returning this rank's data as others'.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.simulation.collective_log import CollectiveLog, recording


@dataclass(frozen=True)
class Shape:
    """A world's size and layout, checked: `nodes` x `local_world_size` ranks, a mesh."""

    world_size: int
    local_world_size: int
    mesh: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size


@dataclass
class FakeWorld:
    """This process as `rank` of a fake world: where it stands and what it would issue."""

    shape: Shape
    rank: int
    group: Any
    mesh: Any = None  # a DeviceMesh when the world was asked for one
    env: dict[str, str] = field(default_factory=dict)  # the torchrun variables it set

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.shape.local_world_size

    @property
    def local_world_size(self) -> int:
        return self.shape.local_world_size

    @property
    def node(self) -> int:
        """This rank's node (torchrun's GROUP_RANK)."""
        return self.rank // self.shape.local_world_size

    @property
    def nodes(self) -> int:
        return self.shape.nodes

    def mesh_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh (None without one)."""
        return None if self.mesh is None else tuple(self.mesh.get_coordinate())

    @contextlib.contextmanager
    def record(self) -> Iterator[CollectiveLog]:
        """Record every collective issued in the block (op, group, mesh dimension, bytes)."""
        names = self._mesh_group_names()
        with recording(names.get) as recorder:
            yield recorder.log

    def _mesh_group_names(self) -> dict[str, str]:
        if self.mesh is None or not self.shape.mesh_dim_names:
            return {}
        return {
            self.mesh.get_group(dim).group_name: dim
            for dim in self.shape.mesh_dim_names
            if self.mesh.size(self.shape.mesh_dim_names.index(dim)) > 1
        }

    def __repr__(self) -> str:
        mesh = f", mesh={self.shape.mesh}" if self.shape.mesh else ""
        return (
            f"FakeWorld(rank={self.rank} of {self.world_size}, node {self.node} of "
            f"{self.nodes}, local rank {self.local_rank}{mesh})"
        )


def shape_of(
    world_size: int | None,
    local_world_size: int | None,
    mesh: Sequence[int] | None,
    mesh_dim_names: Sequence[str] | None,
    launched: dict[str, str],
) -> Shape:
    """The world asked for, with the sizes the call leaves out taken from the environment
    ``launch_env`` set in this test (`launched`); a clear error for a shape that cannot be."""
    world_size = _from_env("world_size", world_size, "WORLD_SIZE", launched)
    if world_size is None and mesh is not None:
        world_size = _product(mesh)
    if world_size is None:
        raise ValueError(
            "fake_world: give world_size (or a mesh, or call launch_env(world_size=...) first)"
        )
    _check_positive("world_size", world_size)
    local = (
        _from_env("local_world_size", local_world_size, "LOCAL_WORLD_SIZE", launched) or world_size
    )
    _check_positive("local_world_size", local)
    if world_size % local:
        raise ValueError(
            f"fake_world: local_world_size {local} must divide world_size {world_size}"
        )
    dims = _mesh_of(world_size, mesh, mesh_dim_names)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    return Shape(world_size, local, dims, names)


def rank_of(shape: Shape, rank: int | None, launched: dict[str, str]) -> int:
    rank = _from_env("rank", rank, "RANK", launched)
    rank = 0 if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < shape.world_size:
        raise ValueError(f"fake_world: rank must be in 0..{shape.world_size - 1}; got {rank!r}")
    return rank


def start(shape: Shape, rank: int, env: dict[str, str], device_type: str) -> FakeWorld:
    """Set up the fake default group (and the mesh) as `rank` of `shape`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group is already set up in this process")
    _hooks.append(sys.excepthook)  # init_process_group wraps it to prefix the rank
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=shape.world_size)
    mesh = None
    if shape.mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, shape.mesh, mesh_dim_names=shape.mesh_dim_names)
    return FakeWorld(shape, rank, dist.group.WORLD, mesh, env)


def stop() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if _hooks:
        sys.excepthook = _hooks.pop()
        _hooks.clear()


_hooks: list[Any] = []  # sys.excepthook as it was before the world started


def swept_ranks(
    world_size: int, ranks: Sequence[int] | None, sample: int | None, seed: int
) -> list[int]:
    """The ranks a sweep visits: `ranks` as given, or a sample of `sample` ranks (always the
    first and the last, the rest drawn with `seed`), or every rank."""
    if ranks is not None and sample is not None:
        raise ValueError("fake_world.sweep: give ranks or sample, not both")
    if ranks is not None:
        chosen = list(ranks)
        for r in chosen:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise ValueError(f"fake_world.sweep: rank {r!r} is not in 0..{world_size - 1}")
        return chosen
    if sample is None or sample >= world_size:
        return list(range(world_size))
    _check_positive("sample", sample)
    ends = {0, world_size - 1}
    middle = [r for r in range(1, world_size - 1)]
    drawn = random.Random(seed).sample(middle, max(0, sample - len(ends)))
    return sorted(ends | set(drawn))[:sample] if sample > 1 else [0]


def _from_env(name: str, given: int | None, variable: str, launched: dict[str, str]) -> int | None:
    """`given`, or the value of `variable` that launch_env set; both must agree."""
    raw = launched.get(variable)
    if raw is None:
        return given
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"fake_world: {variable}={raw!r} is not an integer") from None
    if given is not None and given != value:
        raise ValueError(
            f"fake_world: {name}={given} but launch_env set {variable}={value} in this test: "
            f"give the same, or leave {name} out"
        )
    return value


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"fake_world: {name} must be an int >= 1; got {value!r}")


def _product(dims: Sequence[int]) -> int:
    total = 1
    for d in dims:
        total *= d
    return total


def _mesh_of(
    world_size: int, mesh: Sequence[int] | None, names: Sequence[str] | None
) -> tuple[int, ...] | None:
    if mesh is None:
        if names is not None:
            raise ValueError("fake_world: mesh_dim_names needs a mesh (its sizes)")
        return None
    dims = tuple(mesh)
    for d in dims:
        _check_positive("mesh dimension", d)
    if _product(dims) != world_size:
        raise ValueError(
            f"fake_world: mesh {dims} holds {_product(dims)} ranks, not world_size {world_size}"
        )
    if names is not None and len(tuple(names)) != len(dims):
        raise ValueError(f"fake_world: mesh_dim_names {tuple(names)} must name each of {dims}")
    return dims
