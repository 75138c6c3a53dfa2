"""A rank's process group, kept across consecutive passing tests (gloo).

Setting a gloo group up costs tens of milliseconds per test; most tests leave it as they
found it. A rank keeps its group after a test only when the test returned cleanly and the
group is still the one the harness made (not destroyed or replaced); subgroups the test made
are destroyed first. The pytest side reuses it only when every rank kept it (see ``Pools``),
and tells a rank to drop it when a peer failed or is still running shortly after (a peer
waiting on this rank in a collective must fail fast, not at the deadline). The next test
starts with a bounded barrier on the kept group: ranks out of step fail it, and the harness
then sets a fresh group up. Runs inside ranks.
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
    kept_after: str = ""  # the run after which it was kept


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
    """Start the next test on the kept group, once a bounded barrier finds every rank in step.

    Raises when it does not (a rank left a collective unfinished): the harness then retries
    the set-up with a fresh group.
    """
    assert _current is not None
    dist.monitored_barrier(timeout=timedelta(seconds=CHECK_S))
    _current.before_test = _groups()


def keep(run_key: str) -> str | None:
    """After a clean return: keep the group if it is intact; its id, or None (tear it down)."""
    if _current is None or not dist.is_initialized() or _default() is not _current.pg:
        return None
    for group in list(_pg_map()):
        if id(group) not in _current.before_test:
            dist.destroy_process_group(group)  # the test's subgroups die with the test
    _current.kept_after = run_key
    return _current.id


def kept_after(run_key: str) -> bool:
    """Whether this rank still holds the group it kept after run `run_key`."""
    return _current is not None and _current.kept_after == run_key


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
