"""Labelled collectives that never leave a rank waiting: all_reduce and broadcast_from.

Both are thin public functions over one private core. Each rank runs `fn` itself and joins
the exchange whatever happened, sending its outcome (value, error or exit) rather than only
its value; so when any rank's `fn` fails, every rank learns it in the same exchange and raises
together instead of waiting in a collective the failed rank never reaches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from rankwise import _points, _transport, _wire
from rankwise._launch import is_initialized, launch_world_size, rank, size
from rankwise._wire import Record

_V = TypeVar("_V")


def all_reduce(label: str, fn: Callable[[], _V], combine: Callable[[list[_V]], _V]) -> _V:
    """Run `fn` on every rank and return `combine` of all their values, in rank order.

    Every rank gets the same result. `combine` receives copies loaded from the bytes each rank
    sent (tensors on the CPU); in a single process it receives `fn()`'s value as it is. If
    `fn` fails on any rank, or its value cannot travel (it must load with weights_only), every
    rank raises: a rank whose own `fn` raised re-raises its error, the others raise a
    RuntimeError naming the first failing rank; if the only failures are SystemExits, each
    rank exits with its own code, or the first one's. The same `label` must be used on every
    rank; ranks out of step raise.
    """
    _check_label("all_reduce", label)
    if _single_process("all_reduce", label):
        return combine([fn()])
    with _points.point("all_reduce", label):
        mine, error = _run_fn("all_reduce", label, fn)
        records = [Record.from_bytes(b) for b in _transport.all_gather_bytes(mine.to_bytes())]
    _raise_for_failures(mine, error, records)
    return combine([_wire.decode(record.payload) for record in records])


def broadcast_from(label: str, fn: Callable[[], _V], src: int = 0) -> _V:
    """Run `fn` on rank `src` only and return its value on every rank.

    For a value ranks could disagree on if each computed it (environment, files, GPU). Every
    rank, `src` included, gets a copy loaded from the bytes sent (tensors on the CPU); in a
    single process `fn()`'s value comes back as it is. If `fn` fails on `src`, or its value
    cannot travel, every rank raises instead of waiting: `src` its own error, the others a
    SystemExit with its code if it exited, else a RuntimeError naming it. A receiving rank
    whose label differs from `src`'s raises; `src` cannot tell and returns its value.
    """
    _check_label("broadcast_from", label)
    if isinstance(src, bool) or not isinstance(src, int):
        raise TypeError(f"broadcast_from({label!r}): src must be an int rank; got {src!r}")
    if _single_process("broadcast_from", label):
        _check_src(label, src, 1)
        return fn()
    _check_src(label, src, size())
    with _points.point("broadcast_from", label):
        if rank() == src:
            mine, error = _run_fn("broadcast_from", label, fn)
            _transport.broadcast_bytes(mine.to_bytes(), src)
            if error is not None:
                raise error
            return _wire.decode(mine.payload)  # type: ignore[no-any-return]
        record = Record.from_bytes(_transport.broadcast_bytes(None, src))
    _raise_for_source(label, src, record)
    return _wire.decode(record.payload)  # type: ignore[no-any-return]


# ---- the core ------------------------------------------------------------------------------


def _check_label(kind: str, label: str) -> None:
    if not isinstance(label, str):
        raise TypeError(f"{kind}: label must be a str naming the collective; got {label!r}")


def _check_src(label: str, src: int, world: int) -> None:
    if not 0 <= src < world:
        raise ValueError(
            f"broadcast_from({label!r}): src={src} is not a rank of this run of {world}; "
            f"use 0..{world - 1}"
        )


def _single_process(kind: str, label: str) -> bool:
    """True for a process on its own; raises for a launched rank whose group is not set up."""
    if is_initialized():
        return size() == 1
    world = launch_world_size()
    if world > 1:
        raise RuntimeError(
            f"{kind}({label!r}): this process is one of {world} launched ranks "
            f"(WORLD_SIZE={world}) but no process group is set up; call it inside "
            f"distributed_run(), or after torch.distributed.init_process_group()"
        )
    return True


def _run_fn(kind: str, label: str, fn: Callable[[], object]) -> tuple[Record, BaseException | None]:
    """Run `fn` and encode what happened; whatever it was, the caller still joins."""
    try:
        value = fn()
        payload = _wire.encode(value, f"{kind}({label!r}) on rank {rank()}")
    except SystemExit as exc:
        return Record(kind, label, "exit", code=_exit_code(exc)), exc
    except BaseException as exc:
        return Record(kind, label, "error", error=f"{type(exc).__name__}: {exc}"), exc
    return Record(kind, label, "ok", payload=payload), None


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _raise_for_failures(mine: Record, error: BaseException | None, records: list[Record]) -> None:
    """Raise on every rank if any rank's fn failed (see all_reduce for who raises what)."""
    if any(record.call != mine.call for record in records):
        where = "; ".join(f"rank {r} in {record.call}" for r, record in enumerate(records))
        raise RuntimeError(
            f"{mine.call} on rank {rank()}: ranks out of step ({where}); every rank must "
            f"reach the same labelled collectives in the same order"
        )
    errors = [(r, record) for r, record in enumerate(records) if record.status == "error"]
    if errors:
        if mine.status == "error" and error is not None:
            raise error
        first, record = errors[0]
        raise RuntimeError(f"{mine.call}: rank {first} raised {record.error}")
    exits = [record for record in records if record.status == "exit"]
    if exits:
        if mine.status == "exit" and error is not None:
            raise error
        raise SystemExit(exits[0].code)


def _raise_for_source(label: str, src: int, record: Record) -> None:
    expected = f"broadcast_from({label!r})"
    if record.call != expected:
        raise RuntimeError(
            f"{expected} on rank {rank()}: ranks out of step: src rank {src} is in "
            f"{record.call}; every rank must reach the same labelled collectives in order"
        )
    if record.status == "exit":
        raise SystemExit(record.code)
    if record.status == "error":
        raise RuntimeError(f"{expected}: src rank {src} raised {record.error}")
