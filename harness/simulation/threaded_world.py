"""Threads as ranks: run ``fn(rank)`` on every thread-rank and say how each one ended.

Every thread-rank joins a process group of the harness's own (``thread_group``), so
collectives and point-to-point move real data between threads and mismatched collectives
raise. When a thread-rank fails, the world is aborted: the others, woken from their
collectives, are collateral. The error names the origin first: the rank that rankwise's
errors name (``origin_rank``), else the one that failed first; and carries every rank's
record (``ThreadedWorldError.ranks``). Faults are injected per thread-rank at named points,
as on real ranks, except those that end a whole process (signals, ``os._exit``). A skip on
every thread-rank skips the test.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from harness.common import faults as fault_points
from harness.common.faults import Fault, FaultHangEnded, Injector
from harness.common.outcome import Ending, exit_code

WAKE_S = 1.0  # how long thread-ranks woken after a hang get to end
_NOT_IN_THREADS = ("signal", "hard_exit")


@dataclass
class ThreadRank:
    """How one thread-rank ended."""

    rank: int
    ending: Ending
    value: Any = None
    error: BaseException | None = None
    exit_code: int | None = None
    collateral: bool = False  # failed because another rank did (woken, or named it)
    failed_at: float | None = None  # time.monotonic() when it failed
    skipped: bool = False  # ended by pytest.skip()


class ThreadedWorldError(AssertionError):
    """A thread-rank did not return: raised, called sys.exit, or hung.

    ``origin`` is the rank whose failure caused the others' (None when none can be told),
    ``ranks`` every thread-rank's record, in rank order.
    """

    def __init__(self, message: str, ranks: Sequence[ThreadRank], origin: int | None) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.origin = origin
        self.origin_rank = origin


# Thread-ranks a call gave up on that were still running (rank, thread, the test that made
# them): a thread cannot be killed, and one that went on into a collective would take part in
# a later call's world.
_stale: list[tuple[int, threading.Thread, str]] = []


def run_threaded(
    fn: Callable[[int], Any],
    world_size: int,
    timeout: float,
    faults: Sequence[Fault] = (),
) -> list[Any]:
    """Run `fn(rank)` on `world_size` thread-ranks; every value, or ThreadedWorldError."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("threaded_world: a process group is already set up in this process")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"threaded_world: world_size must be an int >= 1; got {world_size!r}")
    checked = _checked_faults(faults, world_size)
    _wait_for_stale_ranks(timeout)
    ends, threads = _run_world(fn, world_size, timeout, checked)
    origin = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0] or "an earlier call"
    _stale.extend((r, thread, origin) for r, thread in enumerate(threads) if thread.is_alive())
    records = [ends.get(r) or ThreadRank(r, Ending.HUNG) for r in range(world_size)]
    _raise_unless_all_returned(records, timeout)
    return [record.value for record in records]


def _run_world(
    fn: Callable[[int], Any], world_size: int, timeout: float, faults: list[Fault]
) -> tuple[dict[int, ThreadRank], list[threading.Thread]]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    from harness.simulation import thread_group  # imports torch: loaded with the plugin

    threaded: Any = multi_threaded_pg  # torch's per-thread c10d world, untyped
    world = thread_group.ThreadWorld()
    release = threading.Event()  # ends injected hangs once the world is given up
    thread_group.install(world)
    installed = threaded._install_threaded_pg()
    c10d: Any = torch._C._distributed_c10d
    c10d._set_thread_isolation_mode(True)  # each thread-rank registers its own group names
    points = fault_points.rankwise_points()
    if faults and points is not None:
        points.add_observer(fault_points.thread_observer)
    store = dist.HashStore()  # type: ignore[attr-defined]
    hook = sys.excepthook  # each init_process_group wraps it to prefix its rank: put back
    ends: dict[int, ThreadRank] = {}
    closed = threading.Event()  # the call has read `ends`: a late thread records nothing

    def rank_main(rank: int) -> None:
        injector = Injector(rank, tuple(f for f in faults if rank in f.ranks(world_size)))
        injector.release = release
        try:
            with fault_points.on_this_thread(injector):
                dist.init_process_group(
                    thread_group.BACKEND, rank=rank, world_size=world_size, store=store
                )
                injector.at_start()
                value = fn(rank)
                missed = injector.unreached()
                if missed is not None:
                    raise missed
            end = ThreadRank(rank, Ending.RETURNED, value=value)
        except BaseException as exc:
            end = _failure(rank, exc, injector.hung)
            if not end.collateral:
                world.abort(f"rank {rank} {_what_ended(end)}")
        finally:
            if dist.distributed_c10d._world is installed and dist.is_initialized():
                dist.destroy_process_group()
        if not closed.is_set():
            ends[rank] = end

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"thread-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    try:
        for thread in threads:
            thread.start()
        _join_all(threads, time.monotonic() + timeout)
        if any(thread.is_alive() for thread in threads):
            # Wake the thread-ranks waiting in a collective or an injected hang: they end;
            # those hung in their own code stay, and a later call waits for them.
            world.abort(f"the call's timeout ({timeout:g} s) passed with a thread-rank hung")
            release.set()
            _join_all(threads, time.monotonic() + WAKE_S)
    finally:
        closed.set()
        release.set()
        sys.excepthook = hook
        if points is not None:
            points.remove_observer(fault_points.thread_observer)
        c10d._set_thread_isolation_mode(False)
        threaded._uninstall_threaded_pg()
        thread_group.install(None)
    hung = {r for r, thread in enumerate(threads) if thread.is_alive()}
    return {r: e for r, e in dict(ends).items() if r not in hung}, threads


def _failure(rank: int, exc: BaseException, hung: bool) -> ThreadRank:
    """A thread-rank's failure as its record: collateral when woken by the world's end, or
    when rankwise names another rank as the origin."""
    from harness.simulation import thread_group

    now = time.monotonic()
    if isinstance(exc, SystemExit):
        return ThreadRank(rank, Ending.EXITED, error=exc, exit_code=exit_code(exc), failed_at=now)
    if hung or _in_chain(exc, FaultHangEnded):  # its injected hang, ended with the world
        return ThreadRank(rank, Ending.HUNG, error=exc, failed_at=now)
    origin = getattr(exc, "origin_rank", None)
    collateral = _in_chain(exc, thread_group.PeerFailed) or (
        isinstance(origin, int) and origin != rank
    )
    skipped = isinstance(exc, pytest.skip.Exception)
    ending = Ending.RAISED
    return ThreadRank(
        rank, ending, error=exc, collateral=collateral, failed_at=now, skipped=skipped
    )


def _in_chain(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether `exc` or an error it came from is a `kind` (PeerFailed: woken by the world's
    end; FaultHangEnded: its own injected hang)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _what_ended(end: ThreadRank) -> str:
    if end.ending is Ending.EXITED:
        return f"called sys.exit({end.exit_code})"
    if end.ending is Ending.HUNG:
        return "hung"
    return f"raised {type(end.error).__name__}: {end.error}"


def _checked_faults(faults: Sequence[Fault], world_size: int) -> list[Fault]:
    checked = []
    for fault in faults:
        if not isinstance(fault, Fault):
            raise TypeError(f"threaded_world: faults must be Fault objects; got {fault!r}")
        fault = fault_points.validate(fault, world_size, "threaded_world(faults=...)")
        if fault.kind in _NOT_IN_THREADS:
            raise fault_points.FaultError(
                f"threaded_world: a {fault.kind!r} fault ends the whole process, which a "
                f"thread-rank cannot do alone; inject it on real ranks (@pytest.mark.ranks "
                f"with @pytest.mark.fault)"
            )
        checked.append(fault)
    return checked


def _join_all(threads: list[threading.Thread], deadline: float) -> None:
    """Join every thread by one deadline (not the bound once per thread)."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _wait_for_stale_ranks(timeout: float) -> None:
    """Start a world only once every stale thread-rank has ended, waiting up to `timeout`;
    else raise, naming them and the test that left them."""
    _join_all([thread for _, thread, _ in _stale], time.monotonic() + timeout)
    _stale[:] = [entry for entry in _stale if entry[1].is_alive()]
    if _stale:
        ranks = ", ".join(f"thread-rank {rank} of {origin}" for rank, _, origin in _stale)
        raise RuntimeError(
            f"threaded_world: {ranks} still running {timeout:g} s into this call; a thread "
            f"cannot be killed, and it would take part in this world's collectives: end the "
            f"hang in that test (this call starts once it has ended)"
        )


def _origin(records: list[ThreadRank]) -> int | None:
    """The rank whose failure caused the rest: the one rankwise's errors name, else the
    first to fail of those that were not woken by another's failure."""
    named = [
        getattr(r.error, "origin_rank", None) for r in records if r.ending is not Ending.RETURNED
    ]
    named_ranks = [n for n in named if isinstance(n, int) and 0 <= n < len(records)]
    if named_ranks:
        return max(set(named_ranks), key=named_ranks.count)
    causes = [r for r in records if r.ending is not Ending.RETURNED and not r.collateral]
    if not causes:
        return None
    return min(causes, key=lambda r: (r.failed_at is None, r.failed_at or 0.0, r.rank)).rank


def _raise_unless_all_returned(records: list[ThreadRank], timeout: float) -> None:
    bad = [r for r in records if r.ending is not Ending.RETURNED]
    if not bad:
        return
    if all(r.skipped for r in records):
        raise records[0].error  # type: ignore[misc]  # every rank skipped: the test skips
    origin = _origin(records)
    causes = [r for r in bad if not r.collateral or r.rank == origin] or bad
    causes.sort(key=lambda r: (r.rank != origin, r.failed_at or float("inf"), r.rank))
    parts = [_described(r, timeout, r.rank == origin and len(bad) > 1) for r in causes]
    woken = [r.rank for r in bad if r not in causes]
    if woken:
        names = ", ".join(map(str, woken))
        parts.append(
            f"{'rank' if len(woken) == 1 else 'ranks'} {names} collateral (failed because "
            f"rank {origin if origin is not None else causes[0].rank} did)"
        )
    skipped = [r.rank for r in records if r.skipped]
    if skipped:
        parts.append(
            f"a skip must be on every thread-rank: ranks {', '.join(map(str, skipped))} "
            f"skipped, the others did not"
        )
    error = ThreadedWorldError("threaded_world: " + "; ".join(parts), records, origin)
    first = causes[0].error if causes else None
    if first is not None:
        raise error from first
    raise error


def _described(record: ThreadRank, timeout: float, is_origin: bool) -> str:
    mark = " [origin]" if is_origin else ""
    if record.ending is Ending.EXITED:
        return f"rank {record.rank} called sys.exit({record.exit_code}){mark}"
    if record.ending is Ending.HUNG:
        return f"rank {record.rank} hung (still running after {timeout:g} s){mark}"
    if record.skipped:
        return f"rank {record.rank} skipped ({record.error}){mark}"
    error = record.error
    return f"rank {record.rank} raised {type(error).__name__}: {error}{mark}"
