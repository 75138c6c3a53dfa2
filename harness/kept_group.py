"""A rank's process group, kept across consecutive passing tests (gloo).

Setting a gloo group up costs tens of milliseconds per test; most tests leave it as they
found it. A rank keeps its group after a test only when the test returned cleanly and the
group is still the one the harness made (not destroyed or replaced); subgroups the test made
are destroyed first. The pytest side reuses it only when every rank kept it (see ``Pools``),
and tells a rank to drop it when a peer failed or is still running shortly after (a peer
waiting on this rank in a collective must fail fast, not at the deadline). The next test
starts with a check among the ranks (see ``kept_check``): every rank must hold the group and
have made as many operations on it as the others; a failed check makes the harness set a
fresh group up. Runs inside ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from harness import group_release
from harness.kept_check import UNKNOWN_OPS, Channel, Verdict
from harness.outcome import Messages

# How long rank 0 waits for its peers at the check before the group counts as out of step.
CHECK_S = 5.0


@dataclass
class _Group:
    id: str  # the store prefix it was made under: unique per pytest process
    pg: Any  # the default process group object
    before_test: frozenset[int]  # ids of the process groups that existed when the test began
    channel: Channel | None  # to check the ranks are in step before the next test
    ops: int  # the group's operation count on this rank at the last check
    timeout: Any  # its timeout when made: a test that changed it leaves no group behind
    kept_after: str = ""  # the run after which it was kept
    # Point-to-point messages on it since it was made, by peer: sent to, received from. A
    # send nobody received leaves the operation counts equal when each rank has one, but
    # the next test's receive would get it: the pytest side compares these across ranks.
    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    any_source: bool = False  # a receive from any rank: who sent what cannot be told


_current: _Group | None = None


def made(group_id: str, channel: Channel | None) -> None:
    """The harness has just set the default group `group_id` up for a test; without a
    `channel` it is not kept after it."""
    global _current
    forget()
    _current = _Group(group_id, _default(), _groups(), channel, _ops(), _timeout())


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


def reuse(serial: int, wait_s: float) -> None:
    """Start run `serial` on the kept group once every rank is there and in step; a peer
    waits up to `wait_s` for rank 0's word.

    Raises when they are not (a rank without the group, or counts that differ: a send never
    received, a collective left unfinished): the harness then retries with a fresh group.
    """
    assert _current is not None and _current.channel is not None
    ops = _ops()
    since = UNKNOWN_OPS if ops == UNKNOWN_OPS else ops - _current.ops
    verdict = _current.channel.check(serial, since, CHECK_S, wait_s)
    if verdict is Verdict.FAIL:
        raise RuntimeError(
            "the kept process group's check failed: a rank is without it, late, or out of step"
            " (its operation count differs); a fresh group is set up"
        )
    if verdict is Verdict.BARRIER:  # torch cannot count: are the collectives in step?
        dist.monitored_barrier(timeout=timedelta(seconds=CHECK_S))
    _current.ops = _ops()  # the barrier's own operations differ by rank
    _current.before_test = _groups()


def keep(run_key: str) -> str | None:
    """After a clean return: keep the group if it is intact; its id, or None (tear it down)."""
    if _current is None or _current.channel is None:
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
    if _current is not None and _current.channel is not None:
        _current.channel.close()  # peers checking with this rank fail at once
    _current = None


def _default() -> Any:
    return dist.distributed_c10d._get_default_group()


def _ops() -> int:
    """How many operations this rank has made on the default group (collectives and
    point-to-point alike)."""
    try:
        return int(_default()._get_sequence_number_for_group())
    except Exception:  # a torch without it: every check falls back to the barrier
        return UNKNOWN_OPS


def _timeout() -> Any:
    """The default group's timeout as its backends hold it (None where torch hides it)."""
    try:
        pg = _default()
        return tuple(pg._get_backend(device).options._timeout for device in pg._device_types)
    except Exception:
        return None


def _groups() -> frozenset[int]:
    return frozenset(id(group) for group in group_release.process_groups())
