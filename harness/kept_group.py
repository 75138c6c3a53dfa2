"""A rank's process group, kept across consecutive passing tests (gloo).

Setting a gloo group up costs tens of milliseconds per test; most tests leave it as they
found it. A rank keeps its group after a test only when the test returned cleanly, the
group is still the one the harness made (not destroyed or replaced), and a bounded barrier
finds every rank at the same point; subgroups the test made are destroyed first. The pytest
side reuses it only when every rank kept it (see ``Pools``). Runs inside ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# How long the end-of-test barrier may take before the group counts as out of step.
CHECK_S = 5.0


@dataclass
class _Group:
    id: str  # the store prefix it was made under: unique per pytest process
    pg: Any  # the default process group object
    before_test: frozenset[int]  # ids of the process groups that existed when the test began


_current: _Group | None = None


def made(group_id: str) -> None:
    """The harness has just set the default group `group_id` up for a test."""
    global _current
    _current = _Group(group_id, _default(), _groups())


def reusable(group_id: str | None) -> bool:
    """Whether this rank holds `group_id`, intact, to run the next test on."""
    if group_id is None or _current is None or _current.id != group_id:
        return False
    return dist.is_initialized() and _default() is _current.pg


def reuse() -> None:
    """The next test starts on the kept group: note which groups exist before it."""
    assert _current is not None
    _current.before_test = _groups()


def keep(timeout_s: float) -> str | None:
    """After a clean return: keep the group if it is intact and every rank is in step.

    Returns the group's id, or None (the caller then tears it down).
    """
    if _current is None or not dist.is_initialized() or _default() is not _current.pg:
        return None
    for group in list(_pg_map()):
        if id(group) not in _current.before_test:
            dist.destroy_process_group(group)  # the test's subgroups die with the test
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=min(CHECK_S, timeout_s)))
    except Exception:
        return None
    return _current.id


def forget() -> None:
    global _current
    _current = None


def _default() -> Any:
    return dist.distributed_c10d._get_default_group()


def _pg_map() -> dict[Any, Any]:
    world: Any = dist.distributed_c10d._world
    return dict(world.pg_map)


def _groups() -> frozenset[int]:
    return frozenset(id(group) for group in _pg_map())
