"""Wrappers that name the process groups a piece of code communicates over."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from rankwise import _fake
from rankwise._collectives import Call, gather_values, single_process
from rankwise._launch import is_initialized

NOT_IN_USE = -1
# What torch.distributed.new_group returns on a rank outside the new group (-100).
NOT_A_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


class DistributedProcessGroup:
    """A process group, or the whole world (`None`), or a parallelism not in use (`-1`).

    A group that is not in use reports rank and world size -1. So does a group this rank is
    not a member of: torch's `new_group` returns a sentinel on such ranks, which callers pass
    straight in; it is not initialised here, and `get_dist_syncd_obj` skips it on such a
    rank. Without a live default process group (a single process), the world and
    any group report rank 0 of a world of 1.
    """

    def __init__(self, group: Any = None) -> None:
        if isinstance(group, bool) or (
            isinstance(group, int) and group not in (NOT_IN_USE, NOT_A_MEMBER)
        ):
            raise ValueError(
                f"DistributedProcessGroup: group must be a ProcessGroup, None (the whole world) "
                f"or -1 (not in use), or what new_group returns on a rank outside the group "
                f"({NOT_A_MEMBER}); got {group!r}"
            )
        if group is not None and not isinstance(group, int) and not _is_process_group(group):
            raise TypeError(
                f"DistributedProcessGroup: group must be a ProcessGroup, None or -1; "
                f"got {type(group).__name__}"
            )
        self.group = group

    def is_initialized(self) -> bool:
        """Whether this group is in use, has this rank, and a process group is live here."""
        return self._usable() and is_initialized()

    def rank(self) -> int:
        """This process's rank in the group: -1 if not in use or not a member, 0 alone."""
        if not self._usable():
            return -1
        return dist.get_rank(group=self.group) if is_initialized() else 0

    def world_size(self) -> int:
        """The group's size: -1 if not in use or not a member, 1 in a single process."""
        if not self._usable():
            return -1
        return dist.get_world_size(group=self.group) if is_initialized() else 1

    def _usable(self) -> bool:
        return not isinstance(self.group, int) or self.group not in (NOT_IN_USE, NOT_A_MEMBER)

    def __repr__(self) -> str:
        if self.group == NOT_IN_USE:
            return "DistributedProcessGroup(not in use)"
        if isinstance(self.group, int) and self.group == NOT_A_MEMBER:
            return "DistributedProcessGroup(this rank is not a member)"
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

        As modelopt's does, a group that is not initialised (not in use, a group this rank is
        not a member of, or no live process group) is skipped: `obj` goes on unchanged and
        `op` is not called for it, so code written for modelopt gets the same results. Every
        member of an initialised group must call this. Values travel as all_reduce's do,
        never by pickle: they must load with weights_only (register your classes with
        `torch.serialization.add_safe_globals`); a value that does not raises on its rank,
        naming its type, and on every other member instead of leaving them waiting.
        """
        for group in groups if isinstance(groups, list) else [groups]:
            if group.is_initialized():
                obj = op(_members_values(obj, group))
        return obj


def _members_values(obj: Any, group: DistributedProcessGroup) -> list[Any]:
    """Every member's `obj`, in group order (this process's alone in a group of one)."""
    call = Call("get_dist_syncd_obj", "", "get_dist_syncd_obj")
    if single_process(call.text, group.group):
        return [obj]
    if _fake.on_fake_world(group.group):
        raise _fake.not_simulated(call.text, dist.get_rank(), group.group, "the objects")
    return gather_values(call, lambda: obj, group.group)


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
