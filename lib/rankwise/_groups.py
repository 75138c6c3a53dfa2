"""Wrappers that name the process groups a piece of code communicates over."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from rankwise._launch import is_initialized

NOT_IN_USE = -1


class DistributedProcessGroup:
    """A process group, or the whole world (`None`), or a parallelism not in use (`-1`).

    A group that is not in use reports rank and world size -1. Without a live default process
    group (a single process), the world and any group report rank 0 of a world of 1.
    """

    def __init__(self, group: Any = None) -> None:
        if isinstance(group, bool) or (isinstance(group, int) and group != NOT_IN_USE):
            raise ValueError(
                f"DistributedProcessGroup: group must be a ProcessGroup, None (the whole world) "
                f"or -1 (not in use); got {group!r}"
            )
        if group is not None and not isinstance(group, int) and not _is_process_group(group):
            raise TypeError(
                f"DistributedProcessGroup: group must be a ProcessGroup, None or -1; "
                f"got {type(group).__name__}"
            )
        self.group = group

    def is_initialized(self) -> bool:
        """Whether this group is in use and a process group is live in this process."""
        return self.group != NOT_IN_USE and is_initialized()

    def rank(self) -> int:
        """This process's rank in the group: -1 if not in use, 0 in a single process."""
        if self.group == NOT_IN_USE:
            return -1
        return dist.get_rank(group=self.group) if is_initialized() else 0

    def world_size(self) -> int:
        """The group's size: -1 if not in use, 1 in a single process."""
        if self.group == NOT_IN_USE:
            return -1
        return dist.get_world_size(group=self.group) if is_initialized() else 1

    def __repr__(self) -> str:
        if self.group == NOT_IN_USE:
            return "DistributedProcessGroup(not in use)"
        name = "world" if self.group is None else getattr(self.group, "group_name", "group")
        return (
            f"DistributedProcessGroup({name}, rank={self.rank()}, world_size={self.world_size()}, "
            f"initialized={self.is_initialized()})"
        )

    @staticmethod
    def get_dist_syncd_obj(
        obj: Any,
        groups: DistributedProcessGroup | list[DistributedProcessGroup],
        op: Callable[[list[Any]], Any],
    ) -> Any:
        """Combine `obj` over each group in turn: `obj = op([every member's obj])`.

        `op` runs exactly once per group, always on a list, so the result has the same type
        whether or not the run is distributed: a group that is not initialised (not in use,
        or no live process group) has this process as its only member, giving `op([obj])`.
        Every member of an initialised group must call this (it gathers with
        `all_gather_object`, so values must pickle).
        """
        for group in groups if isinstance(groups, list) else [groups]:
            if group.is_initialized():
                values: list[Any] = [None] * group.world_size()
                dist.all_gather_object(values, obj, group=group.group)
            else:
                values = [obj]
            obj = op(values)
        return obj


def _is_process_group(group: Any) -> bool:
    return isinstance(group, dist.ProcessGroup)


class ParallelState:
    """The process groups one module communicates over: data, tensor and expert parallel.

    `None` means the whole world, `-1` a parallelism not in use. By default data parallelism
    spans the world and the others are not in use.
    """

    def __init__(
        self,
        data_parallel_group: Any = None,
        tensor_parallel_group: Any = NOT_IN_USE,
        expert_model_parallel_group: Any = NOT_IN_USE,
    ) -> None:
        self.data_parallel_group = DistributedProcessGroup(data_parallel_group)
        self.tensor_parallel_group = DistributedProcessGroup(tensor_parallel_group)
        self.expert_model_parallel_group = DistributedProcessGroup(expert_model_parallel_group)

    def __repr__(self) -> str:
        return (
            f"ParallelState(data_parallel_group={self.data_parallel_group!r}, "
            f"tensor_parallel_group={self.tensor_parallel_group!r}, "
            f"expert_model_parallel_group={self.expert_model_parallel_group!r})"
        )
