"""A rank's process group, kept across consecutive passing tests (gloo).

Setting a gloo group up costs tens of milliseconds per test; most tests leave it as they
found it. A rank keeps its group after a test only when the test returned cleanly and the
group is still the one the harness made (not destroyed or replaced, its timeout unchanged);
subgroups the test made are destroyed first. The rank then reports how many operations it
has made on the group and its point-to-point messages by peer. The pytest side (``Pools``)
reuses the group only when every rank kept it and those agree: an operation some ranks
skipped, or a send nobody received, would be paired with the next test's. It tells a rank to
drop the group when a peer failed or is still running shortly after (a peer waiting on this
rank in a collective must fail fast, not at the deadline). Runs inside ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from harness import group_release
from harness.outcome import Messages


@dataclass
class _Group:
    id: str  # the store prefix it was made under: unique per pytest process
    pg: Any  # the default process group object
    before_test: frozenset[int]  # ids of the process groups that existed when the test began
    keepable: bool  # whether the run that made it may keep it
    first_op: int | None  # torch's sequence number for it when made (None: torch cannot tell)
    timeout: Any  # its timeout when made: a test that changed it leaves no group behind
    kept_after: str = ""  # the run after which it was kept
    # Point-to-point messages on it since it was made, by peer: sent to, received from. A
    # send nobody received leaves the operation counts equal when each rank has one, but
    # the next test's receive would get it: the pytest side compares these across ranks.
    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    any_source: bool = False  # a receive from any rank: who sent what cannot be told


_current: _Group | None = None


def made(group_id: str, keepable: bool) -> None:
    """The harness has just set the default group `group_id` up for a test; it may be kept
    after the test only if `keepable`."""
    global _current
    forget()
    _current = _Group(group_id, _default(), _groups(), keepable, _sequence(), _timeout())


def operations() -> int | None:
    """How many operations this rank has made on the kept group since it was made
    (collectives and point-to-point alike); None when torch cannot tell."""
    now = _sequence()
    if _current is None or _current.first_op is None or now is None:
        return None
    return now - _current.first_op


def _sequence() -> int | None:
    try:
        return int(_default()._get_sequence_number_for_group())
    except Exception:  # a torch without it: the group is never reused
        return None


def point_to_point() -> Messages | None:
    """(sent, received) messages by peer on the kept group since it was made; None when a
    receive from any source makes them unknowable."""
    if _current is None or _current.any_source:
        return None
    return tuple(sorted(_current.sent.items())), tuple(sorted(_current.received.items()))


def watch_point_to_point() -> None:
    """Count the default group's sends and receives (ProcessGroup.send/recv, which torch's
    send, isend, recv, irecv and batch_isend_irecv call). Once per rank process."""
    cls: Any = torch._C._distributed_c10d.ProcessGroup
    counters = {"send": _count_sent, "recv": _count_received, "recv_anysource": _count_any}
    for name, count in counters.items():
        original = getattr(cls, name, None)
        if original is not None and not getattr(original, "_harness_counts", False):
            setattr(cls, name, _counting(original, count))


def _counting(original: Any, count: Any) -> Any:
    def counted(group: Any, *args: Any, **kwargs: Any) -> Any:
        if _current is not None and group is _current.pg:
            count(_current, *args, **kwargs)
        return original(group, *args, **kwargs)

    counted._harness_counts = True  # type: ignore[attr-defined]
    return counted


def _count_sent(group: _Group, tensors: Any, peer: int = -1, *_: Any, **__: Any) -> None:
    group.sent[peer] = group.sent.get(peer, 0) + 1


def _count_received(group: _Group, tensors: Any, peer: int = -1, *_: Any, **__: Any) -> None:
    group.received[peer] = group.received.get(peer, 0) + 1


def _count_any(group: _Group, *_: Any, **__: Any) -> None:
    group.any_source = True


def reusable(group_id: str | None) -> bool:
    """Whether this rank holds `group_id`, intact, to run the next test on."""
    if group_id is None or _current is None or _current.id != group_id:
        return False
    return dist.is_initialized() and _default() is _current.pg


def reuse() -> None:
    """Start a test on the kept group: its subgroups are the ones made from now on."""
    assert _current is not None
    _current.before_test = _groups()


def keep(run_key: str) -> str | None:
    """After a clean return: keep the group if it is intact; its id, or None (tear it down)."""
    if _current is None or not _current.keepable:
        return None
    if not dist.is_initialized() or _default() is not _current.pg:
        return None
    if _timeout() != _current.timeout:  # the next test would run with this test's bound
        return None
    subgroups = [
        group for group in group_release.process_groups() if id(group) not in _current.before_test
    ]
    group_release.destroy_each(subgroups)  # the test's subgroups die with the test
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


def _timeout() -> Any:
    """The default group's timeout as its backends hold it (None where torch hides it)."""
    try:
        pg = _default()
        return tuple(pg._get_backend(device).options._timeout for device in pg._device_types)
    except Exception:
        return None


def _groups() -> frozenset[int]:
    return frozenset(id(group) for group in group_release.process_groups())
