"""A rank's process group, kept across consecutive passing tests (gloo).

Setting a gloo group up costs tens of milliseconds per test; most tests leave it as they
found it. A rank keeps its group after a test only when the test returned cleanly and the
group is still the one the harness made (not destroyed or replaced, its timeout unchanged);
subgroups the test made are destroyed first, and an operation the test left unfinished on it
means no group is kept. The rank then reports its counts (operations on the group, groups
torch has named) and its point-to-point messages by peer and tag. The pytest side
(``Pools``) reuses the group only when every rank kept it and those agree: an operation some
ranks skipped, or a send nobody received, would be paired with the next test's. It tells a
rank to drop the group when a peer failed or is still running shortly after (a peer waiting
on this rank in a collective must fail fast, not at the deadline). Runs inside ranks.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from harness.common.protocol import COLLECTIVES_KEPT, COUNT_SIZE, FINGERPRINT_SIZE, ISSUED_SIZE
from harness.common.rank_state import Messages
from harness.rank import group_release


@dataclass
class _Group:
    id: str  # the store prefix it was made under: unique per pytest process
    pg: Any  # the default process group object
    before_test: frozenset[int]  # ids of the process groups that existed when the test began
    keepable: bool  # whether the run that made it may keep it
    first_op: int | None  # torch's sequence number for it when made (None: torch cannot tell)
    timeout: Any  # its timeout when made: a test that changed it leaves no group behind
    kept_after: str = ""  # the run after which it was kept
    # Point-to-point messages on it since it was made, by (peer, tag): sent to, received
    # from. A send nobody received leaves the operation counts equal when each rank has
    # one, but the next test's receive would get it: the pytest side compares these.
    sent: dict[tuple[int, int], int] = field(default_factory=dict)
    received: dict[tuple[int, int], int] = field(default_factory=dict)
    any_source: bool = False  # a receive from any rank: who sent what cannot be told
    # The test's operations on it that may not have finished: equal counts of operations
    # that never match (an all_reduce against a broadcast, left unwaited) would hold gloo's
    # threads, and the next test's operations would queue behind them.
    unfinished: list[Any] = field(default_factory=list)
    # torch's registry of functional collectives (DeviceMesh, DTensor) not yet waited for
    # when the test began: they reach the group without its Python methods, so one the test
    # left unwaited shows only here (an entry stays until its tensor is waited for).
    unwaited_before: int | None = None
    store: Any = None  # the store it was made with; each test on it gets keys of its own below
    # The test called a backend object's operations itself (pg._get_backend(...).send):
    # they pass none of the counts above, so the group is not kept.
    backend_used: bool = False


_current: _Group | None = None
# Operations issued on the harness's group in the current test, shared with the pytest side:
# a peer still running that has issued more than a rank that returned waits on it (an event,
# where a guess in seconds once failed slow peers on a busy machine).
_issued = 0
_collectives = 0  # of them, collectives (what every rank must call alike, in order)
fingerprinting = True  # the test's spec.collective_check: note each collective's fingerprint
_board: mmap.mmap | None = None


def share_issued_count(path: str) -> None:
    """Keep the counts and the last collectives' fingerprints in the file at `path`."""
    global _board
    with open(path, "w+b") as f:
        f.truncate(ISSUED_SIZE)
        _board = mmap.mmap(f.fileno(), ISSUED_SIZE)


def _reset_counts() -> None:
    global _issued, _collectives
    _issued = _collectives = 0
    if _board is not None:
        _board[: 2 * COUNT_SIZE] = bytes(2 * COUNT_SIZE)


def note_issued(name: str, args: tuple[Any, ...]) -> None:
    """One more operation issued; a collective's fingerprint is written before its count,
    so the pytest side never reads a count whose fingerprint is not there yet."""
    global _issued, _collectives
    if name not in _POINT_TO_POINT:
        if _board is not None and fingerprinting:
            at = 2 * COUNT_SIZE + (_collectives % COLLECTIVES_KEPT) * FINGERPRINT_SIZE
            text = _fingerprint(name, args).encode()[: FINGERPRINT_SIZE - 1]
            _board[at : at + FINGERPRINT_SIZE] = text.ljust(FINGERPRINT_SIZE, b"\0")
        _collectives += 1
    _issued += 1
    if _board is not None:
        _board[: 2 * COUNT_SIZE] = _issued.to_bytes(COUNT_SIZE, "little") + _collectives.to_bytes(
            COUNT_SIZE, "little"
        )


_POINT_TO_POINT = frozenset({"send", "recv", "recv_anysource"})
# torch.distributed's names for ProcessGroup's methods, as a user calls them.
_CALLED_AS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
    "allgather_coalesced": "all_gather_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base": "reduce_scatter_tensor", "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single", "_end_coalescing": "a coalesced block",
}  # fmt: skip
# Collectives whose tensors may differ in shape from rank to rank (uneven splits).
_ANY_SHAPE = frozenset({"alltoall", "alltoall_base", "all_to_all_single", "_end_coalescing"})


def _fingerprint(name: str, args: tuple[Any, ...]) -> str:
    """'all_reduce [2] float32': the collective as called, and its first tensor."""
    called = _CALLED_AS.get(name, name)
    tensor = _first_tensor(args)
    if tensor is None:
        return called
    dtype = str(tensor.dtype).removeprefix("torch.")
    shape = "" if name in _ANY_SHAPE else f" {list(tensor.shape)}"
    return f"{called}{shape} {dtype}"


def _first_tensor(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def made(group_id: str, keepable: bool) -> None:
    """The harness has just set the default group `group_id` up for a test; it may be kept
    after the test only if `keepable`."""
    global _current
    forget()
    _current = _Group(group_id, _default(), _groups(), keepable, _sequence(), _timeout())
    _reset_counts()
    _current.unwaited_before = unwaited_functional()
    _current.store = _world().pg_map[_current.pg][1]


def counts() -> tuple[int, int] | None:
    """What must be equal on every rank for the kept group to be reused: the operations
    this rank has made on it since it was made (collectives and point-to-point alike), and
    the process groups torch has named by its count (a subgroup made on some ranks only
    would give the next test's new groups different names on different ranks); None when
    torch cannot tell."""
    now = _sequence()
    if _current is None or _current.first_op is None or now is None:
        return None
    return now - _current.first_op, int(_world().group_count)


def _sequence() -> int | None:
    try:
        return int(_default()._get_sequence_number_for_group())
    except Exception:  # a torch without it: the group is never reused
        return None


def point_to_point() -> Messages | None:
    """(sent, received) messages by (peer, tag) on the kept group since it was made; None
    when a receive from any source makes them unknowable."""
    if _current is None or _current.any_source:
        return None
    sent = tuple((peer, tag, n) for (peer, tag), n in sorted(_current.sent.items()))
    received = tuple((peer, tag, n) for (peer, tag), n in sorted(_current.received.items()))
    return sent, received


# ProcessGroup's methods torch.distributed's collectives and point-to-point calls go through.
_OPERATIONS = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
    "gather", "scatter", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
    "barrier", "send", "recv", "recv_anysource", "_end_coalescing",
)  # fmt: skip
UNFINISHED_PRUNE_AT = 64  # a long test's finished operations are let go of past this many


def watch_operations() -> None:
    """Watch the default group's operations: the work each returns (to tell whether the
    test left any unfinished) and the messages each send and receive carries. Once per
    rank process."""
    cls: Any = torch._C._distributed_c10d.ProcessGroup
    for name in _OPERATIONS:
        original = getattr(cls, name, None)
        if original is not None and not getattr(original, "_harness_watches", False):
            setattr(cls, name, _watching(name, original, _COUNTERS.get(name)))
    backend: Any = torch._C._distributed_c10d.Backend
    for name in _OPERATIONS:
        original = backend.__dict__.get(name)
        if original is not None and not getattr(original, "_harness_watches", False):
            setattr(backend, name, _noting_backend_use(original))


def _noting_backend_use(original: Any) -> Any:
    """torch's own calls reach a backend from C++; a call from Python is the test's own."""

    def noted(backend: Any, *args: Any, **kwargs: Any) -> Any:
        if _current is not None:
            _current.backend_used = True
        return original(backend, *args, **kwargs)

    noted._harness_watches = True  # type: ignore[attr-defined]
    return noted


def _watching(name: str, original: Any, count: Any) -> Any:
    def watched(group: Any, *args: Any, **kwargs: Any) -> Any:
        if _current is None or group is not _current.pg:
            return original(group, *args, **kwargs)
        if count is not None:
            count(_current, *args, **kwargs)
        note_issued(name, args)
        work = original(group, *args, **kwargs)
        if hasattr(work, "is_completed"):
            _note_unfinished(_current, work)
        return work

    watched._harness_watches = True  # type: ignore[attr-defined]
    return watched


def _note_unfinished(group: _Group, work: Any) -> None:
    group.unfinished.append(work)
    if len(group.unfinished) >= UNFINISHED_PRUNE_AT:  # their tensors are not kept alive
        group.unfinished[:] = [w for w in group.unfinished if not w.is_completed()]


def _peer_and_tag(args: tuple[Any, ...], kwargs: dict[str, Any], peer_name: str) -> tuple[int, int]:
    peer = args[1] if len(args) > 1 else kwargs.get(peer_name, -1)
    tag = args[2] if len(args) > 2 else kwargs.get("tag", 0)
    return int(peer), int(tag)


def _count_sent(group: _Group, *args: Any, **kwargs: Any) -> None:
    key = _peer_and_tag(args, kwargs, "dstRank")
    group.sent[key] = group.sent.get(key, 0) + 1


def _count_received(group: _Group, *args: Any, **kwargs: Any) -> None:
    key = _peer_and_tag(args, kwargs, "srcRank")
    group.received[key] = group.received.get(key, 0) + 1


def _count_any(group: _Group, *_: Any, **__: Any) -> None:
    group.any_source = True


_COUNTERS = {"send": _count_sent, "recv": _count_received, "recv_anysource": _count_any}


def reusable(group_id: str | None) -> bool:
    """Whether this rank holds `group_id`, intact, to run the next test on."""
    if group_id is None or _current is None or _current.id != group_id:
        return False
    return dist.is_initialized() and _default() is _current.pg


def reuse(store_prefix: str) -> None:
    """Start a test on the kept group: its subgroups are the ones made from now on, and the
    default store (which new_group and the test itself write to) gives it keys of its own
    under `store_prefix`: a group named by its ranks (use_local_synchronization) would
    otherwise meet the addresses the last test's left."""
    assert _current is not None
    _current.before_test = _groups()
    _current.unwaited_before = unwaited_functional()
    _current.backend_used = False
    _reset_counts()
    backend, _ = _world().pg_map[_current.pg]
    store = dist.PrefixStore(store_prefix, _current.store)  # type: ignore[attr-defined]
    _world().pg_map[_current.pg] = (backend, store)


def keep(run_key: str) -> str | None:
    """After a clean return: keep the group if it is intact; its id, or None (tear it down)."""
    if _current is None or not _current.keepable:
        return None
    if not dist.is_initialized() or _default() is not _current.pg:
        return None
    if _timeout() != _current.timeout:  # the next test would run with this test's bound
        return None
    if _current.backend_used:  # operations no count saw: only a fresh group is safe
        return None
    unfinished = any(not work.is_completed() for work in _current.unfinished)
    _current.unfinished.clear()
    if unfinished:  # a collective or message left unfinished: only a fresh group is safe
        return None
    unwaited = unwaited_functional()
    if unwaited is None or unwaited != _current.unwaited_before:  # the same, by another road
        return None
    if _current.pg in _world().pg_coalesce_state:  # a coalescing block an error left open:
        return None  # the next test's collectives would only be queued, never run
    subgroups = [
        group for group in group_release.process_groups() if id(group) not in _current.before_test
    ]
    group_release.destroy_each(subgroups)  # the test's subgroups die with the test
    _current.kept_after = run_key
    return _current.id


def test_made_default_group() -> bool:
    """Whether the default group is one the test set up itself, not the harness's: its
    store may listen on a port (env://, tcp://) that the next test asks for again."""
    return dist.is_initialized() and (_current is None or _default() is not _current.pg)


def kept_after(run_key: str) -> bool:
    """Whether this rank still holds the group it kept after run `run_key`."""
    return _current is not None and _current.kept_after == run_key


def forget() -> None:
    global _current
    _current = None


def _world() -> Any:
    return dist.distributed_c10d._world


def _default() -> Any:
    return dist.distributed_c10d._get_default_group()


def _timeout() -> Any:
    """The default group's timeout as its backends hold it (None where torch hides it)."""
    try:
        pg = _default()
        return tuple(pg._get_backend(device).options._timeout for device in pg._device_types)
    except Exception:
        return None


def unwaited_functional() -> int | None:
    """How many functional collectives no one has waited for (None: torch cannot tell)."""
    try:
        return int(torch._C._distributed_c10d._get_work_registry_size())
    except Exception:
        return None


def _groups() -> frozenset[int]:
    return frozenset(id(group) for group in group_release.process_groups())
