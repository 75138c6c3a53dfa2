"""What this process is: distributed or not, its rank and the run's size, and a barrier.

Two questions are kept apart on purpose. `is_distributed_launch` reads only the launcher's
environment, so it answers before any process group exists (at argument-parsing time);
`is_distributed_run` reads only the live process group.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist


def is_available() -> bool:
    """Whether this torch build has torch.distributed at all."""
    return dist.is_available()


def is_initialized() -> bool:
    """Whether a default process group is set up in this process."""
    return dist.is_available() and dist.is_initialized()


def backend() -> str | None:
    """The default group's backend ("gloo", "nccl", ...), or None without a group."""
    return str(dist.get_backend()) if is_initialized() else None


def rank(group: Any = None) -> int:
    """This process's rank in `group` (default: the whole world); 0 without a group."""
    _check_group("rank", group)
    return dist.get_rank(group=group) if is_initialized() else 0


def size(group: Any = None) -> int:
    """The number of ranks in `group` (default: the whole world); 1 without a group."""
    _check_group("size", group)
    return dist.get_world_size(group=group) if is_initialized() else 1


def is_master(group: Any = None) -> bool:
    """Whether this process is rank 0 of `group`; a single process always is."""
    _check_group("is_master", group)
    return rank(group) == 0


def barrier(group: Any = None) -> None:
    """Wait until every rank of `group` gets here; returns at once without a group."""
    _check_group("barrier", group)
    if is_initialized():
        dist.barrier(group=group)


def _check_group(what: str, group: Any) -> None:
    """A clear error for a group that is no process group (modelopt's -1 for a parallelism
    not in use, say), before torch sees it, or a single process answers as if it were one."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    # What new_group returns on a rank outside the group: torch answers -1 for it.
    if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    raise TypeError(
        f"{what}: group must be a ProcessGroup or None; got {group!r}. For a group that may "
        f"be -1 (not in use), use DistributedProcessGroup(group), whose rank() and "
        f"world_size() return -1 for it"
    )


def launch_world_size() -> int:
    """WORLD_SIZE as the launcher set it (1 when unset), with a clear error when malformed."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return 1
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"WORLD_SIZE={raw!r} is not a positive integer: a launcher such as torchrun sets it "
            f"to the number of ranks; fix or unset it to run as a single process"
        )
    return value


def is_distributed_launch() -> bool:
    """True when a launcher started this process as one of several (WORLD_SIZE > 1).

    Reads the environment only, so it is valid before any process group is set up.
    """
    return launch_world_size() > 1


def is_distributed_run() -> bool:
    """True when a live process group spans more than one rank, whatever its backend."""
    return is_initialized() and dist.get_world_size() > 1


def launch_rank(name: str = "LOCAL_RANK") -> int:
    """A rank variable of the launch environment, checked (LOCAL_RANK by default)."""
    raw = os.environ.get(name)
    if raw is None and name == "LOCAL_RANK":
        raw = os.environ.get("RANK")
    try:
        return int(raw) if raw is not None else 0
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not an integer: the launcher sets it to this process's rank; "
            f"fix or unset it"
        ) from None
